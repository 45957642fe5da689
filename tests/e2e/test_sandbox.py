"""Isolation, end to end (docs/security.md): from inside a running job on a real stack, what
it can reach of other tenants, the store, the broker and its worker.

The stack's own workers run jobs in a sandbox (`e31 up` picks it where the host can give one);
an extra worker started with `--isolation process` runs the same probe as the worker's user,
and shows which of the same attempts then succeed: the test can fail. Skipped, saying why,
where this host cannot give a sandbox (not root, no bubblewrap, no user namespaces).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis

from e31.core import keys
from e31.edge.settings import Settings
from e31.ops.heartbeat import read_workers
from tests.conftest import wait_for
from tests.internet import Internet

from .conftest import Stack

WAIT_S = 90
PROCESS_NODE = "gpu0@unsandboxed"
HOST_NETWORK_NODE = "gpu0@hostnetwork"


@pytest.fixture(scope="module")
def broker(stack: Stack) -> Iterator[redis.Redis]:
    r = redis.Redis.from_url(stack.redis_url)
    yield r
    r.close()


@pytest.fixture(scope="module")
def sandboxed(stack: Stack, broker: redis.Redis) -> None:
    """The stack's workers run their jobs in a sandbox; else the test is skipped, saying why."""
    isolations = {w.isolation for w in read_workers(broker) if w.node != PROCESS_NODE}
    if isolations != {"sandbox"}:
        from e31_worker.attempt.sandbox import sandbox_unavailable
        why = sandbox_unavailable(Settings.load({"home": str(stack.home / "probe")}))
        pytest.skip(f"the stack's workers run jobs as {sorted(isolations)}, not in a sandbox: "
                    f"{why or 'unknown why'}")


@pytest.fixture
def process_worker(stack: Stack, broker: redis.Redis) -> Iterator[int]:
    """An extra `e31 worker --isolation process` with one simulated 80 GB GPU, a class the
    stack lacks: a job asking for gpu_mem_gb 80 runs there, as the worker's own user. Yields
    its worker process's pid."""
    log = open(stack.home / "logs" / "unsandboxed-worker.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "e31.cli", "worker", "--simulate-gpus", "1x80",
                             "--hostname", PROCESS_NODE.partition("@")[2], "--isolation",
                             "process"], env=stack.env_with_redis(), stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        raw = wait_for(lambda: broker.get(keys.worker(PROCESS_NODE)), timeout_s=WAIT_S,
                       what="the unsandboxed worker")
        yield int(json.loads(raw)["pid"])  # type: ignore[arg-type]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        log.close()


@pytest.fixture
def other_tenants_job(stack: Stack, shared_tmp: Path) -> Iterator[Path]:
    """Another tenant's job, running, with a file in its output directory: yields that file's
    path on this host."""
    token = json.loads(stack.e31("tenant", "create", f"neighbour-{shared_tmp.name}",
                                 "--json").stdout)["token"]
    release = shared_tmp / "release"
    job = stack.client(token).submit(entrypoint="sandboxjobs:hold", resources={"gpus": 0},
                                     params={"release": str(release), "secret": "neighbour's"})
    secret = stack.home / "work" / job.id / "attempt-1" / "output" / "secret.txt"
    wait_for(secret.exists, timeout_s=WAIT_S, what="the other tenant's job to write its output")
    try:
        yield secret
    finally:
        release.touch()
        job.wait(timeout=WAIT_S)


def probe(stack: Stack, broker: redis.Redis, other: Path, *, resources: dict[str, Any],
          extra_pids: tuple[int, ...] = ()) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run the probe job; returns (what it saw, its status)."""
    redis_url = stack.redis_url
    password = urlsplit(redis_url).password or ""
    pids = sorted({*_worker_pids(broker), *extra_pids})
    job = stack.client().submit(entrypoint="sandboxjobs:probe", resources=resources, params={
        "read": [str(other), str(other.parent.parent / "claim.json"),
                 str(stack.home / "e31.db"), str(stack.home / "redis.password"),
                 str(stack.home / "profile.json")],
        "write": [str(stack.home / "planted"), str(other.parent / "planted")],
        "pids": pids,
        "secrets": [redis_url, password, str(stack.home / "e31.db")],
    })
    status = job.wait(timeout=WAIT_S)
    return status["result"], status


def _worker_pids(broker: redis.Redis) -> list[int]:
    pids = []
    for key in broker.scan_iter(match=keys.worker_pattern()):
        raw = broker.get(key)
        if raw:
            pids.append(int(json.loads(raw)["pid"]))
    return pids


def test_in_a_sandbox_a_job_reaches_nothing_but_its_own_files(
        stack: Stack, broker: redis.Redis, sandboxed: None, other_tenants_job: Path) -> None:
    # Given another tenant's running job with an output file, the stack's store, broker
    # password and profile in E31_HOME, and the worker processes of the stack
    # When a job of this tenant tries to read, write, signal and spy on them
    seen, status = probe(stack, broker, other_tenants_job, resources={"gpus": 0})

    # Then it runs as its tenant's own uid, and every attempt fails: nothing of it exists
    reaches_nothing(seen, status, other_tenants_job)


def reaches_nothing(seen: dict[str, Any], status: dict[str, Any], other_tenants_job: Path) -> None:
    """The probe's attempts all failed in its sandbox."""
    assert status["attempts"][-1]["isolation"] == "sandbox"
    assert seen["uid"] not in (0, os.getuid())
    assert set(seen["read"].values()) == {"FileNotFoundError"}, seen["read"]
    # (a write on the way to its own directory lands in its private /tmp, never on the host)
    assert seen["write"][str(other_tenants_job.parent / "planted")] == "FileNotFoundError"
    assert not any(Path(path).exists() for path in seen["write"]), seen["write"]
    assert seen["signal"] and set(seen["signal"].values()) == {"ProcessLookupError"}, seen
    assert set(seen["environ"].values()) == {"FileNotFoundError"}, seen["environ"]
    assert seen["env_secrets"] == []


def test_with_isolation_process_the_same_job_reaches_what_the_sandbox_hid(
        stack: Stack, broker: redis.Redis, sandboxed: None, other_tenants_job: Path,
        process_worker: int) -> None:
    # Given the same neighbour, store and workers, and a worker started with
    # --isolation process
    # When the same probe runs there
    seen, status = probe(stack, broker, other_tenants_job, resources={"gpu_mem_gb": 80},
                         extra_pids=(process_worker,))
    try:
        # Then its status says so, it runs as the worker's user, and it reads the other
        # tenant's output, the store and the broker's password, writes into E31_HOME, may
        # signal its worker and reads the broker's URL in the worker's environment. Only its
        # own environment stays clean (the worker drops its E31_* settings for every job).
        assert status["attempts"][-1]["isolation"] == "process"
        assert status["attempts"][-1]["worker"] == PROCESS_NODE
        assert seen["uid"] == os.getuid()
        assert set(seen["read"].values()) == {"read"}, seen["read"]
        assert set(seen["write"].values()) == {"written"}, seen["write"]
        assert seen["signal"][str(process_worker)] == "signalled"
        assert seen["environ"][str(process_worker)] == "E31_REDIS_URL"
        assert seen["env_secrets"] == []
    finally:
        for planted in (stack.home / "planted", other_tenants_job.parent / "planted"):
            planted.unlink(missing_ok=True)


def test_a_warm_started_job_reaches_nothing_either_and_a_command_job_starts_cold(
        stack: Stack, broker: redis.Redis, sandboxed: None, other_tenants_job: Path) -> None:
    # Given the stack's workers, each with its warm process (ready in the background: until
    # then a job starts cold, so the probe is run until one attempt was forked warm)
    deadline = time.monotonic() + WAIT_S
    while True:
        seen, status = probe(stack, broker, other_tenants_job, resources={"gpus": 0})
        attempt = status["attempts"][-1]
        if attempt["start"] == "warm" or time.monotonic() > deadline:
            break

    # Then the warm-started probe reaches nothing of the host either, and its start is timed
    assert attempt["start"] == "warm", attempt
    assert attempt["start_ms"] is not None and attempt["start_ms"] >= 0
    reaches_nothing(seen, status, other_tenants_job)

    # And a command job starts cold, as it always does
    command = stack.client().submit(command=["true"], resources={"gpus": 0}).wait(timeout=WAIT_S)
    assert command["state"] == "succeeded", command
    assert command["attempts"][-1]["start"] == "cold"


def test_network_none_keeps_a_job_from_the_stacks_own_redis(
        stack: Stack, sandboxed: None, host_network_worker: None) -> None:
    # Given the stack's Redis, listening on this host's loopback
    port = urlsplit(stack.redis_url).port
    client = stack.client()

    # When a job without network and one on the host's network (a worker of a pool set to
    # job_network = host) connect to it, on the same worker
    closed = client.submit(entrypoint="sandboxjobs:connect", params={"port": port},
                           resources={"gpu_mem_gb": 80}, network="none").wait(timeout=WAIT_S)
    open_ = client.submit(entrypoint="sandboxjobs:connect", params={"port": port},
                          resources={"gpu_mem_gb": 80}).wait(timeout=WAIT_S)

    # Then only the one with network reaches it
    assert closed["result"] != "connected"
    assert open_["result"] == "connected"


@pytest.fixture
def host_network_worker(stack: Stack, broker: redis.Redis) -> Iterator[None]:
    """An extra sandboxed `e31 worker` of a pool whose operator chose `job_network = host`,
    with one simulated 80 GB GPU (a class the stack lacks): a job asking for gpu_mem_gb 80
    runs there, in a sandbox but on the host's network."""
    log = open(stack.home / "logs" / "host-network-worker.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "e31.cli", "worker", "--simulate-gpus", "1x80",
                             "--hostname", HOST_NETWORK_NODE.partition("@")[2]],
                            env=stack.env_with_redis(E31_JOB_NETWORK="host"), stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: broker.get(keys.worker(HOST_NETWORK_NODE)), timeout_s=WAIT_S,
                 what="the host-network worker")
        yield
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        log.close()


def test_a_job_on_the_default_network_reaches_the_internet_but_not_the_stacks_services(
        stack: Stack, sandboxed: None, internet: Internet,
        host_network_worker: None) -> None:
    # Given the stack's Redis and API on this host's loopback, and a server on the internet
    api = urlsplit(stack.url)
    targets = [["127.0.0.1", urlsplit(stack.redis_url).port], [api.hostname, api.port],
               [internet.address, internet.port]]
    client = stack.client()

    # When a job of the default network, and the same job on a worker of job_network = host,
    # connect to each
    isolated = client.submit(entrypoint="sandboxjobs:reach", params={"targets": targets},
                             resources={"gpus": 0}).wait(timeout=WAIT_S)
    shared = client.submit(entrypoint="sandboxjobs:reach", params={"targets": targets},
                           resources={"gpu_mem_gb": 80}).wait(timeout=WAIT_S)

    # Then the first reaches the internet only, and its attempt says on which network it ran
    redis_at, api_at, internet_at = (f"{h}:{p}" for h, p in targets)
    assert isolated["result"][internet_at] == "connected"
    assert isolated["result"][redis_at] != "connected"
    assert isolated["result"][api_at] != "connected"
    assert isolated["attempts"][-1]["limits"]["network"] == "isolated"
    # While the second reaches the stack's Redis and API: the attack is real where the
    # operator chose the host's network
    assert shared["result"][redis_at] == shared["result"][api_at] == "connected"
    assert shared["attempts"][-1]["limits"]["network"] == "host"
    queue = stack.e31("queue")
    assert "gpu80 host" in queue.stdout and "warning: jobs of gpu80 share" in queue.stderr


def test_status_and_queue_say_how_jobs_are_isolated(stack: Stack, sandboxed: None) -> None:
    # Given a finished job on a sandboxed worker
    job = stack.client().submit(command=["true"], resources={"gpus": 0})
    job.wait(timeout=WAIT_S)

    # Then `e31 status` shows the attempt's isolation and `e31 queue` each class's workers'
    status = json.loads(stack.e31("status", job.id, "--json").stdout)
    assert status["attempts"][-1]["isolation"] == "sandbox"
    assert status["attempts"][-1]["start"] == "cold"
    assert status["attempts"][-1]["start_ms"] > 0
    assert "sandbox" in stack.e31("status", job.id).stdout
    queue = json.loads(stack.e31("queue", "--json").stdout)
    cpu = next(c for c in queue["classes"] if c["size_class"] == "cpu")
    assert cpu["isolation"] == ["sandbox"] and cpu["network"] == ["isolated"]
    shown = stack.e31("queue")
    assert "cpu sandbox" in shown.stdout and "cpu isolated" in shown.stdout
    assert "share their worker's network" not in shown.stderr
