"""Drains: SIGTERM to `e31 worker`, and `e31 worker --drain` from an operator. The running
job gets SIGTERM and the grace period, is requeued as `drained`, and resumes elsewhere from
its checkpoint."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

from e31.client import JobHandle
from tests.conftest import wait_for

from .conftest import Cluster, trail

STEPS = 16
STEP_S = 0.5


def _checkpointing_job(cluster: Cluster) -> JobHandle:
    return cluster.client().submit(entrypoint="chaosjobs:checkpointed", resources={"gpus": 1},
                                   params={"trail": str(cluster.trail_dir), "steps": STEPS,
                                           "step_s": STEP_S},
                                   retries={"max": 0})


def _steps_of_attempt(cluster: Cluster, job_id: str, attempt: int) -> list[int]:
    return [int(m.group(1)) for line in trail(cluster.trail_dir, job_id)
            if f"attempt={attempt} " in line and (m := re.match(r"step=(\d+)", line))]


def _resumed_where_it_stopped(cluster: Cluster, job: JobHandle, drained_host: str) -> None:
    status = job.wait(timeout=90)
    assert [a["reason"] for a in status["attempts"]] == ["drained", "succeeded"]
    assert status["attempts"][0]["worker"].endswith("@" + drained_host)
    assert not status["attempts"][1]["worker"].endswith("@" + drained_host)
    first = _steps_of_attempt(cluster, job.id, 1)
    # The second attempt starts from the first one's last checkpoint: no step is lost,
    # and none is done twice.
    assert status["result"]["resumed_from"] == max(first)
    assert _steps_of_attempt(cluster, job.id, 2) == list(range(max(first) + 1, STEPS + 1))


def test_sigterm_to_e31_worker_drains_its_job_which_resumes_elsewhere_from_its_checkpoint(
        cluster: Cluster) -> None:
    # Given a checkpointing job a few steps in
    job = _checkpointing_job(cluster)
    host = cluster.running_on(job.id)
    wait_for(lambda: len(_steps_of_attempt(cluster, job.id, 1)) >= 3, timeout_s=30,
             what="three steps")

    # When its host's `e31 worker` gets SIGTERM (a deploy, a shutdown)
    launcher = cluster.procs[f"worker-{host}"]
    launcher.send_signal(signal.SIGTERM)

    # Then the launcher exits cleanly, and the job moves on from its checkpoint
    assert launcher.wait(timeout=60) == 0
    _resumed_where_it_stopped(cluster, job, host)


def test_an_operator_drain_requeues_the_job_and_the_drained_worker_is_not_restarted(
        cluster: Cluster) -> None:
    # Given a checkpointing job a few steps in
    job = _checkpointing_job(cluster)
    host = cluster.running_on(job.id)
    wait_for(lambda: len(_steps_of_attempt(cluster, job.id, 1)) >= 3, timeout_s=30,
             what="three steps")

    # When an operator drains that host
    done = subprocess.run([sys.executable, "-m", "e31.cli", "worker", "--drain",
                           "--hostname", host],
                          env=cluster.env, capture_output=True, text=True, timeout=120)

    # Then the command waits until the node stopped, its launcher exits on its own (no
    # restart), and the job resumes on the other host from its checkpoint
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"gpu0@{host}" in done.stdout and "all drained" in done.stdout
    assert cluster.procs[f"worker-{host}"].wait(timeout=60) == 0
    assert "worker_drained" in cluster.log(f"worker-{host}")
    _resumed_where_it_stopped(cluster, job, host)
    assert cluster.heartbeat(host) is None


def test_starting_a_drained_host_again_puts_it_back_in_service(cluster: Cluster) -> None:
    # Given a host an operator drained
    done = subprocess.run([sys.executable, "-m", "e31.cli", "worker", "--drain",
                           "--hostname", "ha"],
                          env=cluster.env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    cluster.procs["worker-ha"].wait(timeout=60)

    # When `e31 worker` starts there again
    cluster.start_worker("ha")

    # Then it beats and takes work
    cluster.wait_worker("ha")
    other = cluster.heartbeat("hb")
    assert other is not None
    os.kill(other["pid"], signal.SIGSTOP)  # only ha can take the job now
    try:
        job = cluster.client().submit(entrypoint="chaosjobs:marked", resources={"gpus": 1},
                                      params={"trail": str(cluster.trail_dir), "seconds": 0.2})
        status = job.wait(timeout=60)
    finally:
        os.kill(other["pid"], signal.SIGCONT)
    assert status["attempts"][-1]["worker"] == "gpu0@ha"
