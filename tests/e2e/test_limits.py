"""Limits on every resource a job can exhaust, end to end: a stack of its own (`e31 up`, two
sandboxed cpu slots) whose attempts may hold 64 processes, 0.25 GB of memory unless they ask
and write 0.05 GB; jobs submitted through the client run into each limit while another job
on the same host runs to its end, and `e31 status --json` shows what each attempt ran under.
The cgroup parts skip, saying why, where the machine gives the worker no cgroups.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e31.core.errors import ClientError, JobFailed
from e31_worker.attempt.attemptlimits import host_memory_gb
from e31_worker.attempt.cgroups import JobCgroups
from tests.conftest import wait_for
from tests.integration.test_limits import FORK_LOOP

from .conftest import Stack
from .stacks import OwnStack, own_stack

# Writes argv[1] MiB to its outputs, then waits for argv[2] (at most a minute).
DISK_WRITER = """
import os, sys, time
mib, release = int(sys.argv[1]), sys.argv[2]
block = os.urandom(1 << 20)
with open(os.path.join(os.environ['E31_OUTPUT_DIR'], 'out.bin'), 'wb') as out:
    for _ in range(mib):
        out.write(block)
        out.flush()
deadline = time.monotonic() + 60
while not os.path.exists(release) and time.monotonic() < deadline:
    time.sleep(0.05)
"""

ONCE = {"retries": {"max": 0}, "resources": {"gpus": 0}, "timeout_s": 120}


@pytest.fixture(scope="module")
def tight(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OwnStack]:
    if JobCgroups.for_node("test-probe@limits") is None:
        pytest.skip("this machine lets the worker create no cgroups (not root, or no memory "
                    "controller)")
    with own_stack(tmp_path_factory.mktemp("limits-home"), "--cpu-slots", "2",
                   E31_ATTEMPT_PIDS_MAX="64", E31_DEFAULT_MEM_GB="0.25",
                   E31_ATTEMPT_DISK_GB="0.05", E31_ATTEMPT_DISK_MAX_GB="1") as st:
        yield st


@pytest.fixture
def shared(tight: OwnStack, tmp_path: Path) -> Path:
    """A directory this test shares with its sandboxed jobs (note and release files)."""
    path = tight.shared / tmp_path.name
    path.mkdir(mode=0o777)
    path.chmod(0o777)
    return path


def status(st: OwnStack, job_id: str) -> dict[str, Any]:
    shown = st.e31("status", job_id, "--json")
    assert shown.returncode == 0, shown.stderr
    return dict(json.loads(shown.stdout))


def python(code: str, *args: str) -> list[str]:
    return [sys.executable, "-c", code, *args]


def test_a_fork_loop_stops_at_the_pools_pids_max_while_another_job_runs_and_status_shows_the_limits(
        tight: OwnStack, shared: Path) -> None:
    # Given a job that forks up to 500 children and holds them
    client = tight.client()
    note, release = shared / "forks", shared / "release"
    forker = client.submit(command=python(FORK_LOOP, "500", str(note), str(release)), **ONCE)

    # When it has forked all it could
    wait_for(note.exists, timeout_s=60, what="the fork loop to note how far it got")

    # Then its forks stopped short of 64 processes with EAGAIN
    forked, refused = note.read_text().split()
    assert refused == "EAGAIN" and 0 < int(forked) < 64, (forked, refused)
    # And meanwhile another job on the same host starts and succeeds
    other = client.submit(command=["sh", "-c", "echo $(echo other-ok)"], **ONCE)
    assert other.wait(timeout=60)["state"] == "succeeded"
    release.touch()
    assert forker.wait(timeout=60)["state"] == "succeeded"
    # And `e31 status --json` shows what its attempt ran under
    [attempt] = status(tight, forker.id)["attempts"]
    assert {k: attempt["limits"][k] for k in ("pids_max", "mem_gb", "disk_gb")} == {
        "pids_max": 64, "mem_gb": 0.25, "disk_gb": 0.05}
    table = subprocess.run([sys.executable, "-m", "e31.cli", "status", forker.id],
                           env=dict(tight.env, COLUMNS="300"), capture_output=True, text=True,
                           timeout=60)
    assert "pids 64, mem 0.25 GB, disk 0.05 GB" in table.stdout, table.stdout


def test_a_job_writing_past_its_disk_limit_ends_disk_quota_unshipped_while_another_keeps_running(
        tight: OwnStack, shared: Path) -> None:
    # Given a job that writes 2 MiB and waits, and one that writes 120 MiB
    client = tight.client()
    modest_release = shared / "modest"
    modest = client.submit(command=python(DISK_WRITER, "2", str(modest_release)), **ONCE)
    wait_for(lambda: client.get(modest.id).status()["state"] == "running", timeout_s=60,
             what="the modest job to run")
    greedy = client.submit(command=python(DISK_WRITER, "120", str(shared / "never")), **ONCE)

    # When the greedy one passes the pool's 0.05 GB
    with pytest.raises(JobFailed) as failed:
        greedy.wait(timeout=90)
    ended = failed.value.status

    # Then it failed with reason disk_quota and none of its outputs were stored
    assert ended["state"] == "failed", ended
    [attempt] = ended["attempts"]
    assert attempt["reason"] == "disk_quota" and "0.05 GB" in attempt["error"]
    assert not ended.get("outputs")
    # And the other job was still running, and succeeds with its output
    assert client.get(modest.id).status()["state"] == "running"
    modest_release.touch()
    done = modest.wait(timeout=60)
    assert done["state"] == "succeeded"
    assert [o["path"] for o in done["outputs"]] == ["out.bin"]


def test_a_job_without_mem_gb_is_oom_killed_past_the_pools_default(tight: OwnStack) -> None:
    # Given a job that asks no memory and allocates 1 GiB on a pool giving 0.25 GB
    job = tight.client().submit(command=python("b = bytearray(1 << 30)"), **ONCE)

    # When it runs, then the kernel ended it and the attempt says at which limit
    with pytest.raises(JobFailed) as failed:
        job.wait(timeout=60)
    ended = failed.value.status
    [attempt] = ended["attempts"]
    assert attempt["reason"] == "oom", ended
    assert "0.25 GB" in attempt["error"]


def test_a_disk_gb_above_the_pools_maximum_is_refused_at_submit(tight: OwnStack) -> None:
    with pytest.raises(ClientError) as refused:
        tight.client().submit(command=["true"], **{**ONCE, "resources": {"gpus": 0,
                                                                        "disk_gb": 2}})
    assert "resources.disk_gb" in str(refused.value)


def test_without_default_mem_gb_a_job_gets_the_hosts_memory_shared_by_its_slots(
        stack: Stack) -> None:
    # Given the session's stack: two GPU workers and two cpu slots on this host, no
    # default_mem_gb set
    if JobCgroups.for_node("test-probe@limits") is None:
        pytest.skip("this machine lets the worker create no cgroups")
    total = host_memory_gb()
    assert total is not None

    # When a job that asks no memory runs
    job = stack.client().submit(command=["true"], resources={"gpus": 0})
    done = job.wait(timeout=60)

    # Then its attempt ran under a quarter of the host's memory, and the pool's other limits
    [attempt] = done["attempts"]
    assert attempt["limits"]["mem_gb"] == pytest.approx(total / 4, abs=0.001)
    assert attempt["limits"]["pids_max"] == 4096 and attempt["limits"]["disk_gb"] == 50.0
