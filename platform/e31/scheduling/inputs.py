"""The live inputs of `e31.scheduling.admission.decide`: worker slots from heartbeats and the
store, the store's candidates per queue, tenants' fair-share view. Pure: the scheduler
reads, this shapes, `decide` chooses.

A worker's GPUs are named `<host>:<index>` (host = the part of its node name after `@`),
so two workers of one host that pin the same GPU (a node advertising one-GPU workers and
a `--group 4` worker over the same GPUs) share them: the group is free only when all four
are (docs/scheduling.md, "Capacity model").
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from datetime import datetime

from e31.core.records import Candidate, Published, RunningJob, TenantShare
from e31.core.usage import UsageState
from e31.ops.heartbeat import WorkerInfo, expand_gangs, gang_place, gang_slot
from e31.scheduling.admission import Slot
from e31.scheduling.fairshare import Tenant

HEADROOM_NODE = "~headroom"   # sorts after real node names: real slots are filled first


def idle_workers(workers: Sequence[WorkerInfo], busy_nodes: set[str]) -> list[WorkerInfo]:
    """Workers free for a job: their heartbeat says so and they hold no live lease."""
    return [w for w in workers if w.busy_job is None and w.node not in busy_nodes]


def shared_queues(workers: Sequence[WorkerInfo]) -> set[str]:
    """Queues with a consumer whose GPUs another worker also pins (the shared layout)."""
    holders: dict[str, int] = defaultdict(int)
    for w in workers:
        for g in w.gpu_ids:
            holders[g] += 1
    return {q for w in workers if any(holders[g] > 1 for g in w.gpu_ids) for q in w.queues}


def slots(workers: Sequence[WorkerInfo], running: Sequence[RunningJob], *,
          headroom: int, placed: Sequence[Published] = ()) -> list[Slot]:
    """One slot per live worker, busy when its heartbeat or a live lease says so, free at its
    job's start + timeout_s; plus `headroom` extra slots per queue that has a consumer and
    shares no GPU (a message may wait there for the next worker to free up). A queue of the
    shared layout gets no headroom: a message waiting there could be taken by a worker whose
    GPUs another worker holds. A host's gang workers count as its GPU sets (`gang_slots`)."""
    by_node: dict[str, RunningJob] = {}
    for r in running:
        if r.node and (r.lease_live or r.node not in by_node):
            by_node[r.node] = r
    out = gang_slots(workers, running, placed)
    for w in (w for w in workers if not w.gang):
        job = by_node.get(w.node)
        busy = w.busy_job is not None or (job is not None and job.lease_live)
        free_at = math.inf
        if busy and job is not None and job.started_at is not None:
            free_at = job.started_at.timestamp() + job.timeout_s
        out.append(Slot(node=w.node, queues=w.queues, gpu_ids=w.gpu_ids, busy=busy,
                        free_at_s=free_at))
    shared = shared_queues(expand_gangs(workers))
    consumed = sorted({q for w in workers if not w.gang for q in w.queues} - shared)
    out += [Slot(node=f"{HEADROOM_NODE}/{q}/{i}", queues=(q,))
            for q in consumed for i in range(headroom)]
    return out


def gang_slots(workers: Sequence[WorkerInfo], running: Sequence[RunningJob],
               placed: Sequence[Published]) -> list[Slot]:
    """The GPU sets of the hosts that run gang workers (docs/scheduling.md, "Gangs on
    demand"), each a slot. A set a job holds (a running attempt of one of the host's gang
    workers, or a dispatch to the host not yet claimed) is busy until that job's bound, and
    holds its GPUs, so that admission counts every set sharing one of them as taken; every
    set of a host whose gang workers are all busy is busy. Ranked so that, among sets equally
    shared, those of busier hosts fill first: small jobs pack onto partly busy nodes and
    leave whole ones for big jobs."""
    gangs = [w for w in workers if w.gang]
    if not gangs:
        return []
    holds: dict[str, float] = {}          # the set a job holds -> when it should be free
    for r in running:
        set_name = held_set(r, {w.host for w in gangs})
        if set_name is not None:
            until = (r.started_at.timestamp() + r.timeout_s) if r.started_at else math.inf
            holds[set_name] = max(holds.get(set_name, until), until)
    for p in placed:
        if p.dispatch_host and p.dispatch_gpus:    # its start is not known yet
            holds[gang_slot(p.dispatch_host, p.dispatch_gpus)] = math.inf
    idle_hosts = {w.host for w in gangs if w.busy_job is None}
    busy_on: dict[str, int] = defaultdict(int)
    for set_name in holds:
        host, gpus = gang_place(set_name) or ("", "")
        busy_on[host] += len(gpus.split(","))
    out = []
    for s in expand_gangs(gangs):
        held = s.node in holds
        until = holds.pop(s.node, math.inf)
        out.append(Slot(node=s.node, queues=s.queues, gpu_ids=s.gpu_ids,
                        busy=held or s.host not in idle_hosts, free_at_s=until,
                        rank=-busy_on[s.host]))
    for set_name, until in holds.items():   # held GPUs that match no set offered now
        host, gpus = gang_place(set_name) or ("", "")
        out.append(Slot(node=set_name, queues=(), busy=True, free_at_s=until,
                        gpu_ids=frozenset(f"{host}:{i}" for i in gpus.split(","))))
    return out


def held_set(r: RunningJob, gang_hosts: Collection[str]) -> str | None:
    """The GPU set (`gang[0,1]@host`) a running job holds on a gang host, where its lease is
    live; None for any other job (a pinned worker's, a cpu slot's)."""
    host = r.node.split("@", 1)[1] if r.node and "@" in r.node else ""
    if not r.lease_live or not r.held_gpus or host not in gang_hosts:
        return None
    return gang_slot(host, r.held_gpus)


def heads_per_queue(all_slots: Sequence[Slot], outstanding: Mapping[str, int], *,
                    per_tenant: int) -> dict[str, int]:
    """K per consumed queue: at least `per_tenant`, and enough to fill every free slot that
    takes the queue, so a lone tenant gets the whole pool in one tick."""
    free: dict[str, int] = defaultdict(int)
    for s in all_slots:
        for q in s.queues:
            free[q] += 0 if s.busy else 1
    return {q: max(per_tenant, n - outstanding.get(q, 0)) for q, n in free.items()}


def per_queue(candidates: Iterable[Candidate]) -> dict[str, list[Candidate]]:
    """The store's heads grouped by queue, as `decide` takes them."""
    out: dict[str, list[Candidate]] = defaultdict(list)
    for c in candidates:
        out[c.queue].append(c)
    return dict(out)


def tenant_views(shares: Iterable[TenantShare], running: Mapping[str, Mapping[str, int]], *,
                 now: datetime, half_life_s: float) -> dict[str, Tenant]:
    """Tenant id -> the policy's view: weight, quotas, decayed usage now, GPUs held per class."""
    out = {}
    for t in shares:
        at_s = t.usage_at.timestamp() if t.usage_at else now.timestamp()
        usage = UsageState(t.usage_gpu_s, at_s).at(now.timestamp(), half_life_s)
        out[t.id] = Tenant(name=t.id, weight=t.weight, quotas=dict(t.quotas), usage_gpu_s=usage,
                           running_gpus=dict(running.get(t.id, {})), disabled=t.disabled)
    return out
