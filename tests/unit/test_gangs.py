"""Gangs on demand, the pure parts: a gang host's GPU sets (launcher), the slots the scheduler
makes of them (inputs.gang_slots) and what admission places there; the host's GPU ledger
under concurrent claims (real processes, real flock)."""

from __future__ import annotations

import multiprocessing
import os
import random
import time
from datetime import UTC, datetime
from itertools import combinations
from pathlib import Path

import pytest

from e31.api.services import top
from e31.core.errors import ConfigError
from e31.core.records import (
    Candidate,
    LeaseHolder,
    Published,
    RunningJob,
    SchedulingView,
    TenantRecord,
)
from e31.core.sizeclasses import DEFAULT_SIZE_CLASSES, class_for_gpu
from e31.ops import pool
from e31.ops.heartbeat import WorkerInfo, expand_gangs, gang_place
from e31.ops.scrape import PoolView
from e31.scheduling.admission import decide
from e31.scheduling.explain import queue_overview
from e31.scheduling.inputs import gang_slots, slots
from e31.store.pool import RunningRow
from e31_worker.attempt.gangs import GpuLedger
from e31_worker.node.gpus import parse_simulated
from e31_worker.node.launcher import gang_sets, plan_slots

NOW = 1_000_000.0


def gang_workers(host: str, simulated: str, *, busy: int = 0) -> list[WorkerInfo]:
    gpus = parse_simulated(simulated)
    sets = gang_sets(gpus, spill=False, classes=DEFAULT_SIZE_CLASSES)
    return [WorkerInfo(node=f"gpu{g.index}@{host}", queues=(f"e31.node.{host}",),
                       gpus=str(g.index), gpu_count=1,
                       size_class=class_for_gpu(g.mem_gb, DEFAULT_SIZE_CLASSES).name, gang=sets,
                       busy_job=f"j-{g.index}" if g.index < busy else None)
            for g in gpus]


def running(host: str, gpus: str, worker: int = 0) -> RunningJob:
    return RunningJob(id=f"r-{host}-{gpus}", tenant_id="t", node=f"gpu{worker}@{host}",
                      size_class="gpu80", gpus=len(gpus.split(",")),
                      started_at=datetime.fromtimestamp(NOW - 10, UTC), timeout_s=100,
                      lease_live=True, held_gpus=gpus)


def job(job_id: str, gpus: int, size_class: str = "gpu80") -> Candidate:
    queue = f"e31.{size_class}" + (f".x{gpus}" if gpus > 1 else "")
    return Candidate(id=job_id, tenant_id="t", queue=queue, size_class=size_class, gpus=gpus,
                     priority=5, submitted_at_s=NOW - 100 + len(job_id), timeout_s=60)


def test_a_gang_host_offers_every_gpu_and_every_aligned_block_of_two_four_and_eight() -> None:
    sets = gang_sets(parse_simulated("8x80"), spill=False, classes=DEFAULT_SIZE_CLASSES)
    assert [g for g, _ in sets] == [*map(str, range(8)), "0,1", "2,3", "4,5", "6,7",
                                     "0,1,2,3", "4,5,6,7", "0,1,2,3,4,5,6,7"]
    assert dict(sets)["0,1,2,3"] == ("e31.gpu80.x4",)
    # and the launcher runs one gang worker per GPU on the host's own queue, no group
    planned = plan_slots(parse_simulated("4x48"), cpu_slots=1, spill=False, group=1,
                         classes=DEFAULT_SIZE_CLASSES, host="h", gangs=True)
    assert [s.node for s in planned] == ["gpu0@h", "gpu1@h", "gpu2@h", "gpu3@h", "cpu0@h"]
    # each watching its own GPU (its telemetry, its XID errors), pinned to none
    assert planned[1].queues == ("e31.node.h",) and planned[1].gpus == "1"
    with pytest.raises(ConfigError, match="--gangs"):
        plan_slots(parse_simulated("4x48"), cpu_slots=0, spill=False, group=2,
                   classes=DEFAULT_SIZE_CLASSES, host="h", gangs=True)


def test_a_set_is_busy_while_a_job_or_an_unclaimed_dispatch_holds_its_gpus() -> None:
    workers = gang_workers("h", "4x80")
    placed = [Published("t", "e31.gpu80.x2", "gpu80", 2, 60, "p", 5, None, "h", "2,3")]
    out = {s.node: s for s in gang_slots(workers, [running("h", "1")], placed)}
    assert sorted(n for n, s in out.items() if s.busy) == ["gang[1]@h", "gang[2,3]@h"]
    assert out["gang[1]@h"].free_at_s == NOW - 10 + 100
    # so admission finds only GPU 0 free
    free = decide(now_s=NOW, slots=list(out.values()), tenants={},
                  heads={"e31.gpu80": [job("a", 1), job("b", 1)],
                         "e31.gpu80.x2": [job("c", 2)]})
    assert [(d.job_id, d.node) for d in free.publish] == [("a", "gang[0]@h")]
    assert gang_place("gang[0,1]@h") == ("h", "0,1") and gang_place("gpu0@h") is None


def test_admission_packs_small_jobs_and_gives_a_big_one_an_aligned_set_of_its_own() -> None:
    # Given two 8-GPU hosts, one running a one-GPU job on GPU 0
    workers = gang_workers("ha", "8x80") + gang_workers("hb", "8x80")
    all_slots = slots(workers, [running("hb", "0")], headroom=1)
    assert not any(s.node.startswith("~") for s in all_slots if "x" in ",".join(s.queues))

    # When a 2-GPU, two one-GPU and a 4-GPU job are placed
    jobs = [job("j2", 2), job("j1a", 1), job("j1b", 1), job("j4", 4)]
    heads: dict[str, list[Candidate]] = {}
    for j in jobs:
        heads.setdefault(j.queue, []).append(j)
    decision = decide(now_s=NOW, slots=all_slots, tenants={}, heads=heads)

    # Then each gets its own GPUs, none shared, and the partly busy host fills up first (its
    # seven free GPUs, in fair order: j2, j4, then j1a) before the whole one is touched
    placed = {d.job_id: gang_place(d.node) for d in decision.publish}
    assert set(placed) == {"j2", "j1a", "j1b", "j4"}
    held = [(host, set(gpus.split(","))) for host, gpus in placed.values()]
    for (h1, g1), (h2, g2) in combinations(held + [("hb", {"0"})], 2):
        assert h1 != h2 or not g1 & g2, placed
    assert [j for j, (host, _) in placed.items() if host == "ha"] == ["j1b"]


def test_expanded_gang_workers_are_what_node_shapes_count() -> None:
    out = expand_gangs(gang_workers("h", "4x48") + gang_workers("h", "4x48"))
    assert len(out) == 4 + 2 + 1 and out[-1].gpu_ids == {f"h:{i}" for i in range(4)}


def test_a_gpu_whose_own_worker_is_gone_is_in_no_set_offered() -> None:
    # Given a 4-GPU gang host whose worker watching GPU 2 was drained (an XID error on it)
    workers = [w for w in gang_workers("h", "4x48") if w.node != "gpu2@h"]
    # Then no set with GPU 2 is offered: the other single GPUs and the block 0-1 are
    assert [w.node for w in expand_gangs(workers)] == [
        "gang[0]@h", "gang[1]@h", "gang[3]@h", "gang[0,1]@h"]
    # and a job still running on GPUs 2-3 holds GPU 3, so admission places nothing there
    out = slots(workers, [running("h", "2,3", worker=0)], headroom=0)
    free = decide(now_s=NOW, slots=out, tenants={}, heads={"e31.gpu48": [
        job("a", 1, "gpu48"), job("b", 1, "gpu48"), job("c", 1, "gpu48")]})
    assert sorted(gang_place(d.node) or ("", "") for d in free.publish) == [
        ("h", "0"), ("h", "1")]


def _claimer(path: str, seed: int, rounds: int, out: multiprocessing.Queue) -> None:
    ledger = GpuLedger(Path(path))
    rnd = random.Random(seed)
    held = []
    for n in range(rounds):
        size = rnd.choice((1, 2, 4))
        start = rnd.randrange(0, 8, size)
        gpus = [str(i) for i in range(start, start + size)]
        if not ledger.take(gpus, f"j-{seed}-{n}"):
            began = time.monotonic()
            time.sleep(0.002)
            held.append((began, time.monotonic(), gpus))
            ledger.give_back(gpus, f"j-{seed}-{n}")
    out.put(held)


def test_concurrent_claims_on_one_host_never_hold_a_gpu_twice(tmp_path: Path) -> None:
    # Given eight processes taking random aligned GPU sets of one host at once
    path = str(tmp_path / "gpus@h.json")
    out: multiprocessing.Queue = multiprocessing.Queue()
    procs = [multiprocessing.Process(target=_claimer, args=(path, seed, 60, out))
             for seed in range(8)]
    for p in procs:
        p.start()
    holds = [h for _ in procs for h in out.get(timeout=120)]
    for p in procs:
        p.join(timeout=60)

    # Then every process took some, and no two holds of one GPU overlap in time
    assert len(holds) > 50
    for (s1, e1, g1), (s2, e2, g2) in combinations(holds, 2):
        assert not (set(g1) & set(g2) and s1 < e2 and s2 < e1), ((s1, e1, g1), (s2, e2, g2))


def test_a_gpu_held_by_a_process_that_died_is_free_again(tmp_path: Path) -> None:
    ledger = GpuLedger(tmp_path / "gpus@h.json")
    child = os.fork()
    if child == 0:
        os._exit(0)
    os.waitpid(child, 0)
    assert ledger.take(["0", "1"], "j-dead", pid=child) == []
    assert ledger.take(["1"], "j-next") == []          # its holder is gone
    assert ledger.take(["1", "2"], "j-other") == ["1"]  # a live holder keeps it
    ledger.give_back(["1"], "j-next")
    assert ledger.holders() == {}


def test_the_pool_shows_a_gang_hosts_gpus_busy_by_the_jobs_holding_them() -> None:
    # Given a 4-GPU gang host whose worker watching GPU 3 runs a job on GPUs 0-1
    workers = gang_workers("h", "4x80")
    workers[3] = workers[3].busy("j01")
    leases = [LeaseHolder("gpu3@h", "gpu80", 2, True, held_gpus="0,1")]

    # Then `e31 top` and the metrics count GPUs 0 and 1 busy, 2 and 3 idle
    states = {s.node: s.state for s in pool.slots(workers, leases, draining=())}
    assert states == {"gpu0@h": "busy", "gpu1@h": "busy", "gpu2@h": "idle", "gpu3@h": "idle"}
    # And `e31 top` puts the job on the GPUs it holds, not on the GPU its worker watches
    row = RunningRow(id="j01", name="n", tenant_id="t", tenant="team", size_class="gpu80",
                     gpus=2, node="gpu3@h", attempt=1, started_at=None, progress_done=None,
                     progress_total=None, lease_expires_at=datetime.fromtimestamp(NOW + 60, UTC),
                     held_gpus="0,1")
    shown = top.snapshot(classes=["gpu80"], backlog={}, running=[row],
                         view=PoolView(tuple(workers), frozenset(), {}),
                         viewer=TenantRecord(id="t", name="team", weight=1.0, admin=True),
                         now=datetime.fromtimestamp(NOW, UTC))
    assert {g["gpu"]: g["job"] for g in shown["gpus"]} == {"0": "j01", "1": "j01", "2": None,
                                                          "3": None}
    # And `e31 queue` counts the host's four GPUs once each, two of them busy
    overview = queue_overview(classes=DEFAULT_SIZE_CLASSES, workers=workers,
                              view=SchedulingView([], [running("h", "0,1", worker=3)], []),
                              tenants={}, queued={}, running={}, viewer=None)
    [gpu80] = [c for c in overview["classes"] if c["size_class"] == "gpu80"]
    assert (gpu80["gpus"], gpu80["busy_gpus"]) == (4, 2)
