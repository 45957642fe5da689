"""Kills: a worker SIGKILLed mid-job, only the job's child SIGKILLed, a poison job."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from e31.core.errors import JobFailed
from tests.conftest import host_pid, process_alive, process_state, wait_for

from .conftest import Cluster, billed_seconds, parse_ts, running_cluster, trail

WAIT_S = 90
# The recovery test's lease. Recovery is the launcher's poll (0.5 s) and its release of the
# dead process's attempt, then a tick and a claim; the 2 × TTL bound leaves a busy 2-core
# machine, where a tick and a claim can each wait seconds for a core, room to spare, and
# holds even where the launcher's release failed and the scheduler's watch of silent
# workers (or, at the latest, the lease) recovered the job.
RECOVERY_TTL_S = 6.0


def _started(cluster: Cluster, job_id: str) -> list[str]:
    return [line for line in trail(cluster.trail_dir, job_id) if line.startswith("start")]


def _pid(line: str) -> int:
    match = re.search(r"pid=(\d+)", line)
    assert match, line
    return int(match.group(1))


@pytest.fixture
def leased(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Cluster]:
    """The two-host cluster with a lease of `request.param` seconds (each test names its
    own, and says why that one)."""
    with running_cluster(tmp_path, E31_LEASE_TTL_S=str(request.param)) as c:
        yield c


@pytest.mark.parametrize("leased", [RECOVERY_TTL_S], indirect=True)
def test_the_job_of_a_sigkilled_worker_runs_again_within_two_ttls_and_succeeds_once(
        leased: Cluster) -> None:
    cluster = leased
    # Given a job running on one of two workers
    job = cluster.client().submit(entrypoint="chaosjobs:marked", resources={"gpus": 1},
                                  params={"trail": str(cluster.trail_dir), "seconds": 4},
                                  retries={"max": 0})
    host = cluster.running_on(job.id)
    wait_for(lambda: _started(cluster, job.id), timeout_s=30, what="the job to start")
    first_pid = host_pid(job.id, _pid(_started(cluster, job.id)[0]))
    beat = cluster.heartbeat(host)
    assert beat is not None

    # When its worker process is SIGKILLed
    killed_at = time.time()
    os.kill(beat["pid"], signal.SIGKILL)

    # Then its job process dies with it, its launcher releases the job at once (without
    # waiting for its new worker process or the lease), it runs again and ends once
    wait_for(lambda: not process_alive(first_pid), timeout_s=10, what="the orphaned job to die")
    status = job.wait(timeout=WAIT_S)
    assert [a["reason"] for a in status["attempts"]] == ["lost", "succeeded"]
    assert status["result"] == {"attempt": 2}
    assert "its launcher released the job at once" in status["attempts"][0]["error"]
    assert f"worker_released job={job.id}" in cluster.log(f"worker-{host}")
    lost_ended_at = parse_ts(status["attempts"][0]["ended_at"]).timestamp()
    restarted_at = parse_ts(status["attempts"][1]["started_at"]).timestamp()
    assert parse_ts(status["attempts"][0]["started_at"]).timestamp() <= lost_ended_at \
        <= restarted_at
    recovery_s = restarted_at - killed_at
    assert recovery_s <= 2 * RECOVERY_TTL_S, f"recovered after {recovery_s:.1f} s"
    events = trail(cluster.trail_dir, job.id)
    assert sum(e.startswith("done") for e in events) == 1, events
    assert status["gpu_seconds"] == pytest.approx(billed_seconds(status), abs=0.01)


# A whole node SIGKILLed (its launcher, its worker processes, their jobs): nothing is left on
# it to say so, and its job must run again elsewhere long before its lease expires
# (docs/reliability.md, "A dead node noticed in seconds"). The lease is the pool's default,
# so that only the scheduler's watch of silent workers can recover it within the bound
# (the heartbeat's 0.5 s makes silence 2 s, SILENT_MIN_S); the bound leaves a busy 2-core
# machine seconds for a tick, a publication, a claim and a Python start.
NODE_TTL_S = 10.0
NODE_RECOVERY_S = 8.0


@pytest.mark.parametrize("leased", [NODE_TTL_S], indirect=True)
def test_the_job_of_a_sigkilled_node_runs_again_elsewhere_in_seconds_and_succeeds_once(
        leased: Cluster) -> None:
    cluster = leased
    # Given a scheduler past its first lease TTL of leading (a leader that just took the lead,
    # on a Redis it sees new, judges no lease and no silence for one TTL, so that workers that
    # could not reach it may renew: under load the node was killed inside that hold and
    # recovered at the lease's expiry, 9.6 s), and a job running on one of two hosts
    wait_for(lambda: "scheduler_leading" in cluster.log("scheduler"), timeout_s=30,
             what="the scheduler to lead")
    leading_seen = time.monotonic()
    wait_for(lambda: time.monotonic() - leading_seen > NODE_TTL_S + 1, timeout_s=NODE_TTL_S + 5,
             what="the scheduler's first lease TTL of leading to pass")
    job = cluster.client().submit(entrypoint="chaosjobs:marked", resources={"gpus": 1},
                                  params={"trail": str(cluster.trail_dir), "seconds": 4},
                                  retries={"max": 0})
    host = cluster.running_on(job.id)
    wait_for(lambda: _started(cluster, job.id), timeout_s=30, what="the job to start")
    first_pid = host_pid(job.id, _pid(_started(cluster, job.id)[0]))

    # When the whole node is SIGKILLed: its launcher and every process of its group at once
    killed_at = time.time()
    os.killpg(cluster.procs[f"worker-{host}"].pid, signal.SIGKILL)

    # Then its job runs again on the other host within seconds, not at its lease's expiry,
    # and ends once
    wait_for(lambda: not process_alive(first_pid), timeout_s=10, what="the orphaned job to die")
    status = job.wait(timeout=WAIT_S)
    assert [a["reason"] for a in status["attempts"]] == ["lost", "succeeded"]
    assert "went silent" in (status["attempts"][0]["error"] or "")
    assert str(status["attempts"][1]["worker"]).rpartition("@")[2] != host
    restarted_at = parse_ts(status["attempts"][1]["started_at"]).timestamp()
    recovery_s = restarted_at - killed_at
    assert recovery_s <= NODE_RECOVERY_S, f"recovered after {recovery_s:.1f} s"
    events = trail(cluster.trail_dir, job.id)
    assert sum(e.startswith("done") for e in events) == 1, events
    assert status["gpu_seconds"] == pytest.approx(billed_seconds(status), abs=0.01)


# A node back before it could be judged silent: a slow heartbeat (silence after 1.5 beats, 12 s)
# and a long lease, so that only the release of the new launcher's start recovers in time.
REBOOT_BEAT_S = 8.0
REBOOT_TTL_S = 40.0
REBOOT_RECOVERY_S = 10.0


def test_a_node_killed_whole_and_started_again_at_once_releases_its_old_job_at_its_start(
        tmp_path: Path) -> None:
    with running_cluster(tmp_path, E31_HEARTBEAT_INTERVAL_S=str(REBOOT_BEAT_S),
                         E31_LEASE_TTL_S=str(REBOOT_TTL_S)) as cluster:
        # Given a job running on one of two hosts
        job = cluster.client().submit(entrypoint="chaosjobs:marked", resources={"gpus": 1},
                                      params={"trail": str(cluster.trail_dir), "seconds": 4},
                                      retries={"max": 0})
        host = cluster.running_on(job.id)
        wait_for(lambda: _started(cluster, job.id), timeout_s=30, what="the job to start")

        # When the whole node is SIGKILLed and its launcher started again at once, long
        # before its silence could be judged (its new launcher beats for it meanwhile)
        killed_at = time.time()
        os.killpg(cluster.procs[f"worker-{host}"].pid, signal.SIGKILL)
        cluster.start_worker(host)

        # Then the new launcher released the old attempt at its start, and the job ran again
        # within seconds, not at the silence or the lease, once
        status = job.wait(timeout=WAIT_S)
        assert [a["reason"] for a in status["attempts"]] == ["lost", "succeeded"]
        assert "was gone when its node's launcher started again" in (
            status["attempts"][0]["error"] or ""), status["attempts"][0]
        recovery_s = parse_ts(status["attempts"][1]["started_at"]).timestamp() - killed_at
        assert recovery_s <= REBOOT_RECOVERY_S, f"recovered after {recovery_s:.1f} s"
        events = trail(cluster.trail_dir, job.id)
        assert sum(e.startswith("done") for e in events) == 1, events


def test_a_job_whose_own_process_is_sigkilled_fails_that_attempt_and_is_retried(
        cluster: Cluster) -> None:
    # Given a running job with one retry
    job = cluster.client().submit(entrypoint="chaosjobs:marked", resources={"gpus": 1},
                                  params={"trail": str(cluster.trail_dir), "seconds": 3},
                                  retries={"max": 1, "backoff_s": 0})
    wait_for(lambda: _started(cluster, job.id), timeout_s=30, what="the job to start")

    # When only the job's process is SIGKILLed (not by the kernel's OOM killer)
    os.kill(host_pid(job.id, _pid(_started(cluster, job.id)[0])), signal.SIGKILL)

    # Then that attempt is an error that names the signal, and the retry succeeds once
    status = job.wait(timeout=WAIT_S)
    assert [a["reason"] for a in status["attempts"]] == ["error", "succeeded"]
    assert status["attempts"][0]["error"] == "killed by signal SIGKILL"
    events = trail(cluster.trail_dir, job.id)
    assert sum(e.startswith("done") for e in events) == 1, events
    assert status["gpu_seconds"] == pytest.approx(billed_seconds(status), abs=0.01)


@pytest.fixture
def unsandboxed(tmp_path: Path) -> Iterator[Cluster]:
    """The two-host cluster with workers started `--isolation process`: the only kind on which
    a job can reach its worker at all (a sandboxed one cannot even see it:
    tests/e2e/test_sandbox.py)."""
    with running_cluster(tmp_path, E31_ISOLATION="process") as c:
        yield c


def test_a_job_that_kills_every_worker_it_lands_on_fails_as_a_poison_job(
        unsandboxed: Cluster) -> None:
    cluster = unsandboxed
    # Given a job that SIGKILLs its own worker process, allowed to be lost twice
    job = cluster.client().submit(entrypoint="chaosjobs:kill_worker", resources={"gpus": 1},
                                  retries={"max": 5, "max_lost": 2})

    # When it runs
    with pytest.raises(JobFailed) as failed:
        job.wait(timeout=WAIT_S)

    # Then it fails after two lost attempts, saying why, without using its five retries
    status = failed.value.status
    assert [a["reason"] for a in status["attempts"]] == ["lost", "lost"]
    assert status["reason"] == "lost" and "poison job" in status["error"]


# The successor must settle the attempt before the lease expires, as with the default 10 s
# lease a restarted worker does in a second or two; the suite's 3 s lease is shorter than
# the freeze, the kill, the launcher's restart and a Python start on a busy 2-core machine
# (the scheduler then recovered the job as lost and ran it again, which this test forbids).
SETTLE_TTL_S = 15.0


@pytest.mark.parametrize("leased", [SETTLE_TTL_S], indirect=True)
def test_a_worker_killed_after_its_job_returned_is_settled_by_its_successor_without_a_rerun(
        leased: Cluster) -> None:
    cluster = leased
    # Given a job whose code has returned (its result is written) while its worker has not
    # recorded the outcome yet: the worker is frozen before the job may return, so however
    # slow this machine, it can neither store the output nor record the outcome first
    release = cluster.shared / "release"
    job = cluster.client().submit(entrypoint="chaosjobs:big_output", resources={"gpus": 1},
                                  params={"trail": str(cluster.trail_dir), "megabytes": 16,
                                          "release": str(release)})
    host = cluster.running_on(job.id)
    wait_for(lambda: "done" in [e.split()[0] for e in trail(cluster.trail_dir, job.id)],
             timeout_s=60, what="the job to write its output")
    beat = cluster.heartbeat(host)
    assert beat is not None
    worker = beat["pid"]
    os.kill(worker, signal.SIGSTOP)
    try:
        wait_for(lambda: process_state(worker) == "T", timeout_s=10, what="the worker to stop")
        release.touch()
        result_file = cluster.home / "work" / job.id / "attempt-1" / "result.json"
        wait_for(result_file.exists, timeout_s=60, what="the job's result file")

        # When its worker process is SIGKILLed before it recorded the outcome
        os.kill(worker, signal.SIGKILL)
    except BaseException:
        os.kill(worker, signal.SIGCONT)
        raise

    # Then the worker process its launcher starts records it: one attempt, one run
    status = job.wait(timeout=WAIT_S)
    assert [a["reason"] for a in status["attempts"]] == ["succeeded"], status["attempts"]
    events = trail(cluster.trail_dir, job.id)
    assert [e.split()[0] for e in events] == ["start", "done"], events
    # (its log line follows the record the wait saw)
    wait_for(lambda: f"attempt_settled job={job.id}" in cluster.log(f"worker-{host}"),
             timeout_s=30, what="the successor to log the settled attempt")
    assert [o["path"] for o in status["outputs"]] == ["big.bin"]
