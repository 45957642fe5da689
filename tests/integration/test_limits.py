"""Limits on every resource a job can exhaust (e31_worker.attempt.attemptlimits), with real cgroups
and real processes: a fork loop stops at `pids.max` inside its job only, a job without
`resources.mem_gb` is OOM-killed past the pool's default (its tmpfs counted too), a job that
writes past its disk limit ends `disk_quota` with its files removed while another keeps
running; a `resources.disk_gb` over the pool's maximum is refused at submit; and the limits
an attempt ran under are stored and shown. Each limit is also run raised, and then lets the
same job through: the test would catch the hole it closes.

The cgroup tests need root and the memory (and pids) controllers; they skip, saying why,
elsewhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from e31.core.records import Claim, Outcome
from e31.core.spec import JobSpec
from e31.core.states import AttemptReason, Start
from e31.edge.settings import Settings
from e31.store import Repo
from e31.store.attempts import AttemptFacts
from e31_worker.attempt.attemptlimits import AttemptLimits, attempt_limits, default_mem_gb
from e31_worker.attempt.cgroups import JobCgroups
from e31_worker.attempt.plan import AttemptPlan, Directive
from e31_worker.attempt.supervisor import Supervisor
from e31_worker.attempt.warm import WarmStarter, warm_env
from tests.conftest import wait_for
from tests.integration.conftest import MakeApp
from tests.integration.test_attempt_facts import running_job

MiB = 1 << 20

# An entrypoint that forks up to `want` children that stay alive: returns what it forked.
FORK_MODULE = """
import errno, os, time


def fork_loop(ctx, want):
    n, refused = 0, None
    while n < want:
        try:
            pid = os.fork()
        except OSError as exc:
            refused = errno.errorcode[exc.errno]
            break
        if pid == 0:
            time.sleep(120)
            os._exit(0)
        n += 1
    return {'forked': n, 'refused': refused}
"""

# The same loop as a command: forks up to argv[1], notes "<forked> <errno name or None>" in
# argv[2], then holds its children until argv[3] exists (at most a minute).
FORK_LOOP = FORK_MODULE + """
import sys
want, note, release = int(sys.argv[1]), sys.argv[2], sys.argv[3]
done = fork_loop(None, want)
with open(note + '.tmp', 'w') as f:
    f.write(f"{done['forked']} {done['refused']}")
os.rename(note + '.tmp', note)
deadline = time.monotonic() + 60
while not os.path.exists(release) and time.monotonic() < deadline:
    time.sleep(0.05)
"""

# Writes `argv[1]` MiB, one MiB at a time, half to its outputs and half to its scratch,
# then waits for argv[2] (at most a minute).
DISK_WRITER = """
import os, sys, time
mib, release = int(sys.argv[1]), sys.argv[2]
block = os.urandom(1 << 20)
with open(os.path.join(os.environ['E31_OUTPUT_DIR'], 'out.bin'), 'wb') as out, \\
        open(os.path.join(os.environ['E31_SCRATCH_DIR'], 'scratch.bin'), 'wb') as scratch:
    for i in range(mib):
        (out if i % 2 else scratch).write(block)
        out.flush(); scratch.flush()
deadline = time.monotonic() + 60
while not os.path.exists(release) and time.monotonic() < deadline:
    time.sleep(0.05)
"""


@pytest.fixture
def cgroups() -> Iterator[JobCgroups]:
    groups = JobCgroups.for_node(f"test-{os.getpid()}@limits")
    if groups is None:
        pytest.skip("this machine lets the tests create no memory cgroup (not root, or no "
                    "memory controller)")
    yield groups
    groups.reap()


@pytest.fixture
def pids_cgroups(cgroups: JobCgroups) -> JobCgroups:
    if not cgroups.caps_pids:
        pytest.skip("this machine has no pids cgroup controller the tests may use")
    return cgroups


def plan(tmp_path: Path, job_id: str, settings: Settings, *, default_mem: float | None = None,
         **spec: Any) -> AttemptPlan:
    """An attempt of `spec` with the limits `settings` give it."""
    parsed = JobSpec.parse({"resources": {"gpus": 0}, **spec})
    return AttemptPlan(job_id=job_id, attempt=1, spec=parsed, gpus="",
                       root=tmp_path / job_id / "attempt-1", kill_grace_s=1.0,
                       log_max_bytes=1 << 20, tick_interval_s=0.1,
                       limits=attempt_limits(settings, parsed, default_mem=default_mem))


class Running:
    """An attempt run by its Supervisor in a thread; `outcome` once it ended."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.outcome: Outcome | None = None
        self._thread = threading.Thread(target=self._run, args=(supervisor,), daemon=True)
        self._thread.start()

    def _run(self, supervisor: Supervisor) -> None:
        self.outcome = supervisor.run()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def wait(self, timeout_s: float = 60) -> Outcome:
        wait_for(lambda: not self._thread.is_alive(), timeout_s=timeout_s,
                 what="the attempt to end")
        assert self.outcome is not None
        return self.outcome


def supervisor(p: AttemptPlan, cgroups: JobCgroups | None, *,
               on_limits: Callable[[AttemptLimits], None] | None = None,
               warm: WarmStarter | None = None,
               on_start: Callable[[float, Start], None] | None = None) -> Supervisor:
    return Supervisor(p, tick=lambda progress: Directive.CONTINUE, cgroups=cgroups,
                      on_limits=on_limits, warm=warm, on_start=on_start)


def fork_loop(tmp_path: Path, name: str, settings: Settings, want: int,
              cgroups: JobCgroups) -> tuple[Running, Path, Path]:
    note, release = tmp_path / f"{name}.note", tmp_path / f"{name}.release"
    p = plan(tmp_path, f"j-{name}", settings,
             command=[sys.executable, "-c", FORK_LOOP, str(want), str(note), str(release)])
    return Running(supervisor(p, cgroups)), note, release


# -- processes ------------------------------------------------------------------------------

def test_a_fork_loop_is_stopped_at_pids_max_inside_its_job_while_another_job_starts_and_succeeds(
        tmp_path: Path, pids_cgroups: JobCgroups) -> None:
    # Given a pool whose attempts may hold 64 processes, and a job forking 500 that it holds
    settings = Settings(attempt_pids_max=64)
    loop, note, release = fork_loop(tmp_path, "forker", settings, 500, pids_cgroups)

    # When it has forked all it could
    wait_for(note.exists, timeout_s=30, what="the fork loop to note how far it got")

    # Then its forks past the limit failed with EAGAIN, inside the job
    forked, refused = note.read_text().split()
    assert refused == "EAGAIN" and 0 < int(forked) < 64, (forked, refused)
    assert loop.running
    # And, while it holds them, another job on the same host starts, forks and succeeds
    other = plan(tmp_path, "j-other", settings,
                 command=["sh", "-c", "echo $(echo other-ok)"])
    assert supervisor(other, pids_cgroups).run().reason is AttemptReason.SUCCEEDED
    assert "other-ok" in other.log_path.read_text()
    # And the host still forks
    assert subprocess.run(["true"], check=False).returncode == 0
    release.touch()
    assert loop.wait().reason is AttemptReason.SUCCEEDED


def test_with_the_pools_default_pids_max_the_same_loop_forks_all_it_asks(
        tmp_path: Path, pids_cgroups: JobCgroups) -> None:
    # Given the default limit (4096 processes) and the same loop asking for 200
    release = tmp_path / "roomy.release"
    release.touch()
    loop, note, _ = fork_loop(tmp_path, "roomy", Settings(), 200, pids_cgroups)

    # When it runs
    outcome = loop.wait()

    # Then no fork was refused
    assert outcome.reason is AttemptReason.SUCCEEDED
    assert note.read_text().split() == ["200", "None"]


@pytest.mark.parametrize("sandboxed", [False, True], ids=["process", "sandbox"])
def test_a_warm_started_job_is_held_to_pids_max_too(tmp_path: Path, pids_cgroups: JobCgroups,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    sandboxed: bool) -> None:
    # Given a warm process (and a sandbox), and an entrypoint job forking 500 children under a
    # limit of 64
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    jobs.chmod(0o755)
    (jobs / "forkjobs.py").write_text(FORK_MODULE)
    monkeypatch.setenv("PYTHONPATH", str(jobs), prepend=os.pathsep)
    spec = {"entrypoint": "forkjobs:fork_loop", "params": {"want": 500}}
    sandbox = None
    if sandboxed:
        from tests.integration.test_sandbox import TENANT, Jail
        jail = Jail(tmp_path)
        p = dataclasses.replace(jail.plan(**spec, resources={"gpus": 0}),
                                limits=AttemptLimits(pids_max=64))
        sandbox = jail.sandbox.for_attempt(Claim(job_id=p.job_id, tenant_id=TENANT, token=1,
                                                 attempt=1, spec=p.spec, gpus=0))
    else:
        p = plan(tmp_path, "j-warmfork", Settings(attempt_pids_max=64), **spec)
    warm = WarmStarter(preload=[], env=warm_env(os.environ))
    warm.start()
    try:
        assert warm.wait_ready(120), "the warm process did not start"
        starts: list[Start] = []

        # When it is forked from the warm process
        outcome = Supervisor(p, tick=lambda progress: Directive.CONTINUE, cgroups=pids_cgroups,
                             sandbox=sandbox, warm=warm,
                             on_start=lambda ms, how: starts.append(how)).run()
    finally:
        warm.close()

    # Then it started warm, and its forks stopped at the limit
    assert starts == [Start.WARM]
    assert outcome.reason is AttemptReason.SUCCEEDED, (outcome, p.log_path.read_text())
    assert outcome.result["refused"] == "EAGAIN" and outcome.result["forked"] < 64


# -- memory ---------------------------------------------------------------------------------

ALLOCATE_256_MIB = [sys.executable, "-c", "b = bytearray(256 << 20); print(len(b))"]


def test_a_job_without_mem_gb_is_oom_killed_past_the_pools_default_mem_gb(
        tmp_path: Path, cgroups: JobCgroups) -> None:
    # Given a pool whose jobs get 64 MiB unless they ask, and a job that asks nothing and
    # allocates 256 MiB
    settings = Settings(default_mem_gb=0.0625)
    applied: list[AttemptLimits] = []
    p = plan(tmp_path, "j-hungry", settings, default_mem=default_mem_gb(settings, 4),
             command=ALLOCATE_256_MIB)

    # When it runs
    outcome = supervisor(p, cgroups, on_limits=applied.append).run()

    # Then the kernel killed it at the default, and the attempt says which limit it was
    assert outcome.reason is AttemptReason.OOM, (outcome, p.log_path.read_text())
    assert "default of 0.0625 GB" in (outcome.error or "")
    assert [a.mem_gb for a in applied] == [0.0625]


def test_the_same_job_with_the_hosts_share_of_memory_as_its_default_succeeds(
        tmp_path: Path, cgroups: JobCgroups) -> None:
    # Given no default_mem_gb: the host's memory shared by one slot (far above 256 MiB)
    settings = Settings()
    p = plan(tmp_path, "j-fed", settings, default_mem=default_mem_gb(settings, 1),
             command=ALLOCATE_256_MIB)
    assert p.limits.mem_gb is not None and p.limits.mem_gb > 1

    # When the same job runs, then it succeeds
    assert supervisor(p, cgroups).run().reason is AttemptReason.SUCCEEDED


def test_a_job_filling_its_sandboxs_dev_shm_is_out_of_memory_not_of_disk(
        tmp_path: Path, cgroups: JobCgroups) -> None:
    # Given a sandboxed job with the pool's 64 MiB default that writes 256 MiB to /dev/shm
    from tests.integration.test_sandbox import Jail
    jail = Jail(tmp_path)
    fill = ("import os\nblock = os.urandom(1 << 20)\n"
            "with open('/dev/shm/fill', 'wb') as f:\n"
            "    for _ in range(256):\n        f.write(block)\n")
    p = dataclasses.replace(jail.plan(command=[sys.executable, "-c", fill],
                                      resources={"gpus": 0}),
                            limits=AttemptLimits(mem_gb=0.0625))

    # When it runs in its sandbox and cgroup
    outcome = jail.run(p, cgroups=cgroups)

    # Then its tmpfs pages were charged to its cgroup: the kernel ended it as out of memory
    assert outcome.reason is AttemptReason.OOM, (outcome, p.log_path.read_text())


# -- disk -----------------------------------------------------------------------------------

def disk_writer(tmp_path: Path, name: str, settings: Settings, mib: int,
                cgroups: JobCgroups | None,
                **spec: Any) -> tuple[Running, AttemptPlan, Path]:
    release = tmp_path / f"{name}.release"
    p = plan(tmp_path, f"j-{name}", settings,
             command=[sys.executable, "-c", DISK_WRITER, str(mib), str(release)], **spec)
    return Running(supervisor(p, cgroups)), p, release


def test_a_job_writing_past_its_disk_limit_ends_disk_quota_with_its_files_removed_while_another_keeps_running(  # noqa: E501
        tmp_path: Path) -> None:
    # Given a pool whose attempts may write 0.05 GB (51 MiB), a job writing 120 MiB, and
    # another job on the same host that writes 2 MiB and keeps running
    settings = Settings(attempt_disk_gb=0.05)
    other, other_plan, other_release = disk_writer(tmp_path, "modest", settings, 2, None)
    wait_for(lambda: (other_plan.output_dir / "out.bin").exists(), timeout_s=30,
             what="the modest job to write")
    greedy, greedy_plan, _ = disk_writer(tmp_path, "greedy", settings, 120, None)

    # When the greedy job's writes pass the limit
    outcome = greedy.wait(timeout_s=60)

    # Then it was stopped with reason disk_quota, and what it wrote is gone
    assert outcome.reason is AttemptReason.DISK_QUOTA, outcome
    assert "0.05 GB" in (outcome.error or "")
    assert list(greedy_plan.output_dir.iterdir()) == []
    assert list(greedy_plan.work_dir.iterdir()) == []
    # And the other job kept running, and succeeds with its files
    assert other.running
    other_release.touch()
    assert other.wait().reason is AttemptReason.SUCCEEDED
    assert (other_plan.output_dir / "out.bin").stat().st_size == MiB


def test_a_job_that_asks_for_more_disk_writes_the_same_amount_and_succeeds(
        tmp_path: Path) -> None:
    # Given the same greedy job asking resources.disk_gb = 0.2 on that pool
    settings = Settings(attempt_disk_gb=0.05)
    running, p, release = disk_writer(tmp_path, "asked", settings, 120, None,
                                      resources={"gpus": 0, "disk_gb": 0.2})
    assert p.limits.disk_gb == 0.2
    release.touch()

    # When it runs, then it succeeds and keeps its outputs
    assert running.wait().reason is AttemptReason.SUCCEEDED
    assert (p.output_dir / "out.bin").stat().st_size == 60 * MiB


# -- submit, record, show -------------------------------------------------------------------

def test_a_disk_gb_above_the_pools_maximum_is_refused_at_submit_naming_the_field(
        make_app: MakeApp, repo: Repo) -> None:
    from fastapi.testclient import TestClient

    from e31.core.clock import utcnow
    # Given a pool whose attempts may ask at most 1 GB of disk
    api = TestClient(make_app(attempt_disk_max_gb=1.0))
    _, secret = repo.create_tenant("team-disk", now=utcnow())
    headers = {"Authorization": f"Bearer {secret}"}
    job = {"command": ["true"], "resources": {"gpus": 0}}

    # When a job asks for 2 GB, and another for 0.5 GB
    refused = api.post("/v1/jobs", headers=headers,
                       json={**job, "resources": {"gpus": 0, "disk_gb": 2}})
    accepted = api.post("/v1/jobs", headers=headers,
                        json={**job, "resources": {"gpus": 0, "disk_gb": 0.5}})

    # Then the first is refused with 422 naming resources.disk_gb and the pool's maximum
    assert refused.status_code == 422, refused.text
    [error] = refused.json()["errors"]
    assert error["field"] == "resources.disk_gb" and "attempt_disk_max_gb" in error["reason"]
    # And the second is queued
    assert accepted.status_code in (200, 201), accepted.text


def test_the_limits_an_attempt_ran_under_are_stored_and_shown_in_its_status(
        tmp_path: Path, repo: Repo, cgroups: JobCgroups) -> None:
    # Given a running attempt of a stored job, run under the pool's limits
    tenant_id, job_id, n = running_job(repo, "team-limits")
    settings = Settings(attempt_pids_max=128, default_mem_gb=2.0, attempt_disk_gb=7.5)
    p = plan(tmp_path, job_id, settings, default_mem=default_mem_gb(settings, 2),
             command=["true"])

    # When its supervisor notes the limits it applied
    outcome = supervisor(p, cgroups, on_limits=lambda limits: repo.note_attempt(
        job_id, n, AttemptFacts(limits=limits.to_dict()))).run()

    # Then the job's status shows them on the attempt
    assert outcome.reason is AttemptReason.SUCCEEDED
    [attempt] = repo.get_job(tenant_id, job_id).to_status()["attempts"]
    assert attempt["limits"] == {"pids_max": 128 if cgroups.caps_pids else None,
                                 "mem_gb": 2.0, "disk_gb": 7.5}


def test_a_worker_reaps_its_own_stacks_cgroups_never_another_stacks_of_the_same_node_name(
        ) -> None:
    # Given two stacks on this host whose workers serve the same node name, each in its place
    node = f"test-{os.getpid()}@places"
    mine, theirs = (JobCgroups.for_node(node, place=p) for p in ("aaaa1111", "bbbb2222"))
    if mine is None or theirs is None:
        pytest.skip("this machine lets the tests create no memory cgroup (not root, or no "
                    "memory controller)")
    live = theirs.create("j-theirs", 1, memory_max_bytes=None)
    left = mine.create("j-mine", 1, memory_max_bytes=None)
    assert live is not None and left is not None
    try:
        # When one stack's worker starts again and reaps what its predecessor left
        reaped = mine.reap()

        # Then it removed its own leftover, and the other stack's live attempt is still there
        assert reaped == 1 and not left.path.exists()
        assert live.path.is_dir()
    finally:
        theirs.reap()
        for groups in (mine, theirs):
            with contextlib.suppress(OSError):
                groups._base.rmdir()


def test_without_a_place_of_its_own_a_restarted_worker_reaps_the_other_stacks_live_job(
        ) -> None:
    # Given two stacks' workers of the same node name and no place each (as before places)
    node = f"test-{os.getpid()}@shared"
    mine, theirs = JobCgroups.for_node(node), JobCgroups.for_node(node)
    if mine is None or theirs is None:
        pytest.skip("this machine lets the tests create no memory cgroup (not root, or no "
                    "memory controller)")
    live = theirs.create("j-theirs", 1, memory_max_bytes=None)
    assert live is not None

    # When one starts again and reaps
    mine.reap()

    # Then the other stack's live attempt was taken too: what the place prevents
    assert not live.path.exists()
    with contextlib.suppress(OSError):
        mine._base.rmdir()
