"""The runbooks' embedded-stack steps, run as written against a real `e31 up` (issue 17).

Each test creates the situation its runbook is for (a drain, a GPU's XID drain, a killed
Redis, a killed worker process, a job no worker serves, a migration, a full disk), then runs the
blocks the page marks `e31-test=<step>` (tests/docblocks.py) in order, with the variables
the page names (`NODE`, `JOB`), and checks what the page promises. Blocks that no test runs
say so on the page ("not run by the tests: …"); test_docs.py fails on an unmarked one.

The session's `stack` serves the situations that leave it whole; drains, the Redis kill and
the migration (which begins with `e31 down`) use a stack of their own (tests/e2e/stacks.py);
the full disk, one whose E31_HOME is a small tmpfs the test mounts and fills (root only).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
from alembic.script import ScriptDirectory

from e31.core import keys
from e31.ops.drain import request_drain
from e31.store import Repo, make_engine
from e31.store.migrate import MIGRATIONS_DIR
from tests.conftest import process_alive, wait_for
from tests.docblocks import (
    Ran,
    console_steps,
    doc,
    output_contains,
    output_matches,
    run_block,
    run_command,
)
from tests.e2e.chaos.conftest import Cluster, Postgres, make_cluster
from tests.integration.test_http_inputs import Quiet, Serving

from .conftest import Stack
from .stacks import OwnStack, own_stack

WAIT_S = 90
STACK_TEST_TIMEOUT_S = 400   # with the start of the stack it is the first to use
PAGES = "docs/runbooks/"


def _env(st: Stack, **extra: str) -> dict[str, str]:
    """The stack's environment as an operator's shell has it: `e31`, `redis-cli` on PATH."""
    path = os.pathsep.join([str(Path(sys.executable).parent), st.env.get("PATH", "")])
    return dict(st.env, PATH=path, **extra)


def _follow(st: Stack, page: str, step: str, cwd: Path, **variables: str) -> str:
    """Run the page's blocks marked `e31-test=step`, in order; each must exit 0."""
    outputs = []
    for block in doc(PAGES + page).run_blocks(step):
        ran: Ran = run_block(block, env=_env(st, **variables), cwd=cwd)
        assert ran.returncode == 0, f"{block.where} exited {ran.returncode}:\n{ran.output}"
        outputs.append(ran.output)
    return "\n".join(outputs)


def _live(st: Stack, node: str) -> bool:
    client = redis.Redis.from_url(st.redis_url)
    try:
        return client.get(keys.worker(node)) is not None
    finally:
        client.close()


def _beating(st: Stack) -> set[str]:
    """The worker nodes whose heartbeat is in Redis now."""
    client = redis.Redis.from_url(st.redis_url)
    try:
        return {k.decode().removeprefix(keys.worker("")) for k in
                client.scan_iter(match=keys.worker_pattern())}
    finally:
        client.close()


def _running(job: Any) -> bool:
    return bool(job.status()["state"] == "running")


def _worker_pid(st: Stack, node: str) -> int | None:
    client = redis.Redis.from_url(st.redis_url)
    try:
        raw = client.get(keys.worker(node))
    finally:
        client.close()
    return int(json.loads(raw)["pid"]) if raw else None


# --- on the session's stack --------------------------------------------------------------

@pytest.mark.timeout(STACK_TEST_TIMEOUT_S)
def test_stuck_queued_job_and_class_without_workers(stack: Stack, tmp_path: Path) -> None:
    # Given a job of a class that no worker of the stack serves (its GPUs are 24 and 48 GB)
    job = stack.client().submit(entrypoint="e31_worker.examples:hello",
                                resources={"gpu_mem_gb": 80}, name="stuck")
    wait_for(lambda: job.status().get("pending"), timeout_s=WAIT_S,
             what="the scheduler to say why it waits")
    # When the operator follows stuck-queued-job.md's diagnosis
    out = _follow(stack, "stuck-queued-job.md", "diagnose", tmp_path, JOB=job.id,
                  COLUMNS="200")
    # Then the status says queued and why (issue 32: the page's query printed an empty
    # reason for a queue no worker serves), and the store's row shows its queue, never published
    assert "queued" in out
    assert "no worker serves e31.gpu80" in out, out
    assert "e31.gpu80||0" in out, out
    # and E31ClassWithoutWorkers.md's confirmation shows the class and its queued job
    confirm = _follow(stack, "E31ClassWithoutWorkers.md", "confirm", tmp_path)
    assert "gpu80" in confirm
    # and the runbook's fix (the owner cancels) ends it
    _follow(stack, "stuck-queued-job.md", "fix", tmp_path, JOB=job.id)
    assert job.status()["state"] == "cancelled"


@pytest.mark.timeout(STACK_TEST_TIMEOUT_S)
def test_worker_node_down(stack: Stack, tmp_path: Path) -> None:
    # Given a job running on a worker process that is then killed with SIGKILL
    job = stack.client().submit(entrypoint="e31_worker.examples:sleep",
                                params={"seconds": 4, "steps": 8}, resources={"gpus": 0},
                                name="node-down")
    wait_for(lambda: _running(job), timeout_s=WAIT_S, what="the job to run")
    node = job.status()["attempts"][-1]["worker"]
    pid = _worker_pid(stack, node)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: _worker_pid(stack, node) not in (None, pid), timeout_s=WAIT_S,
             what="the launcher to restart the worker process")
    # When the operator follows worker-node-down.md's check
    out = _follow(stack, "worker-node-down.md", "check", tmp_path, NODE=node, JOB=job.id)
    # Then the restart is logged and the job ran again to success after a lost attempt
    assert f"worker_died node={node}" in out
    assert "['lost', 'succeeded']" in out, out
    # and E31LeaseExpiriesRising.md's confirmation shows the lost attempt and its error
    confirm = _follow(stack, "E31LeaseExpiriesRising.md", "confirm", tmp_path, JOB=job.id,
                      COLUMNS="300")      # the error column whole
    # (its launcher releases the job at once: "died … released"; where that failed, the
    # restarted process beats without the job: "went silent"; a lease run out: "expired")
    assert "lost" in confirm and (f"its worker process {node} died" in confirm
                                  or f"worker {node} went silent" in confirm
                                  or f"lease of worker {node} expired" in confirm), confirm


@pytest.mark.timeout(STACK_TEST_TIMEOUT_S)
def test_jobs_idle(stack: Stack, tmp_path: Path) -> None:
    # Given a job that sleeps without a word, flagged idle after 2 s (on_idle: flag)
    job = stack.client().submit(command=["sleep", "120"], resources={"gpus": 0},
                                idle_timeout_s=2, name="hung")
    try:
        wait_for(lambda: job.status()["idle_since"], timeout_s=WAIT_S, what="the idle flag")
        # When the operator confirms it as E31JobsIdle.md says
        out = _follow(stack, "E31JobsIdle.md", "confirm", tmp_path, JOB=job.id, COLUMNS="200")
        # Then the job shows among the running ones, flagged idle, and its log is read
        assert "hung" in out and "running (idle)" in out and "idle_since" in out, out
        # and jobs.md's `e31 status` of an idle job shows what it shows
        [(command, shown)] = console_steps(doc("docs/jobs.md").run_blocks("idle")[0])
        ran = run_command(command.replace("j-…", job.id), env=_env(stack, COLUMNS="200"),
                          cwd=tmp_path)
        # (the page shows two rows of the table: its columns are as wide as this job's rows)
        shown = [" ".join(re.sub(r"\d{4}-\S+", "…", line).split()) for line in shown]
        got = "\n".join(" ".join(line.split()) for line in ran.output.splitlines())
        assert ran.returncode == 0 and output_contains(shown, got), f"{shown}\n{ran.output}"
    finally:
        job.cancel()


@pytest.mark.timeout(STACK_TEST_TIMEOUT_S)
def test_metrics_down_checks_on_the_embedded_stack(stack: Stack, tmp_path: Path) -> None:
    # When the operator runs E31MetricsDown.md's checks with the stack's address and token
    # (issue 32: the page's only checks read Compose's secrets/metrics_token, absent here)
    out = _follow(stack, "E31MetricsDown.md", "embedded", tmp_path)
    # Then the API answers its health check and /metrics takes the token `e31 up` wrote
    assert out.splitlines()[0] == "200", out
    assert "e31_store_up 1.0" in out, out


@pytest.mark.timeout(STACK_TEST_TIMEOUT_S)
def test_gpu_ecc_errors_jobs_that_ran_on_the_gpu(stack: Stack, tmp_path: Path) -> None:
    # Given a job that ran on the stack's 24 GB GPU (index 0) and one on the cpu class
    on_gpu = stack.client().submit(command=["true"], resources={"gpus": 1, "gpu_mem_gb": 24},
                                   name="on-gpu0")
    on_cpu = stack.client().submit(command=["true"], resources={"gpus": 0}, name="on-cpu")
    assert on_gpu.wait(timeout=WAIT_S)["state"] == "succeeded"
    assert on_cpu.wait(timeout=WAIT_S)["state"] == "succeeded"
    # When the operator lists the jobs of the last hour on that GPU, as E31GpuEccErrors.md
    # says (issue 32: the page asked to tell their owners and gave no way to find them)
    out = _follow(stack, "E31GpuEccErrors.md", "owners", tmp_path,
                  HOST=socket.gethostname(), GPU="0")
    # Then the GPU's job is listed with its tenant, and the cpu job is not
    assert re.search(rf"^{on_gpu.id}\|default\|gpu\d@[^|]+\|0\|", out, re.M), out
    assert on_cpu.id not in out, out


@pytest.mark.timeout(STACK_TEST_TIMEOUT_S)
def test_artifact_retention_dry_run(stack: Stack, tmp_path: Path) -> None:
    out = _follow(stack, "artifact-retention.md", "gc", tmp_path)
    assert out.strip()


# --- on a stack of their own: drains, a Redis kill, a migration that stops the stack -----

@pytest.fixture(scope="module")
def own(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OwnStack]:
    with own_stack(tmp_path_factory.mktemp("runbookhome"), "--cpu-slots", "2") as st:
        yield st


@pytest.mark.timeout(STACK_TEST_TIMEOUT_S)
def test_drain_a_worker(own: OwnStack, tmp_path: Path) -> None:
    # Given a job running on a node of the stack, which ignores SIGTERM (the whole grace)
    job = own.client().submit(command=["sh", "-c", "trap '' TERM; sleep 300"],
                              resources={"gpus": 0}, name="to-drain")
    wait_for(lambda: _running(job), timeout_s=WAIT_S, what="the job to run")
    node = job.status()["attempts"][-1]["worker"]
    # When the operator follows drain-a-worker.md on the embedded stack
    out = _follow(own, "drain-a-worker.md", "drain", tmp_path, NODE=node)
    status = job.status()
    # Then the stack's own launcher was shown (issue 32: pgrep listed every stack's), and
    # "all drained" came once the job was requeued
    launcher = own.state()["children"]["worker"]
    assert f"{launcher} " in out and "worker --keep-drains" in out, out
    assert "all drained" in out
    assert status["attempts"][0]["reason"] == "drained"
    # and the node stays out of service, as `e31 queue` says
    _follow(own, "drain-a-worker.md", "verify", tmp_path, NODE=node)
    assert not _live(own, node)
    job.cancel()
    # and undrain puts it back
    _follow(own, "drain-a-worker.md", "undrain", tmp_path, NODE=node)
    wait_for(lambda: _live(own, node), timeout_s=WAIT_S, what=f"{node} back in service")


@pytest.mark.timeout(STACK_TEST_TIMEOUT_S)
def test_gpu_xid_error_confirm(own: OwnStack, tmp_path: Path) -> None:
    # Given a node that took itself out of service after a GPU's XID error (its record)
    node = f"cpu1@{socket.gethostname()}"
    wait_for(lambda: _live(own, node), timeout_s=WAIT_S, what=f"{node} live")
    repo = Repo(make_engine(f"sqlite:///{own.home / 'e31.db'}"), half_life_s=3600.0)
    try:
        request_drain(redis.Redis.from_url(own.redis_url), repo, [node],
                      reason="GPU error: XID 79 on GPU 0")     # as the worker words it
    finally:
        repo.engine.dispose()
    wait_for(lambda: not _live(own, node), timeout_s=WAIT_S, what="the node to drain")
    # When the operator confirms it as E31GpuXidError.md says
    out = _follow(own, "E31GpuXidError.md", "confirm", tmp_path)
    # Then `e31 queue` names the node out of service with the XID
    assert f"out of service: {node}" in out and "XID 79" in out, out
    # and so does operations.md's "XID errors drain the worker", for this node and GPU
    [(command, shown)] = console_steps(doc("docs/operations.md").run_blocks("xid")[0])
    ran = run_command(command, env=_env(own), cwd=tmp_path)
    shown = [line.replace("gpu3@node7", node).replace("GPU 3", "GPU 0") for line in shown]
    shown = [re.sub(r"since \S+:", "since …:", line) for line in shown]
    assert ran.returncode == 0 and output_matches(shown, ran.output), f"{shown}\n{ran.output}"
    # and once the GPU is fixed, the page's undrain puts the node back in service
    _follow(own, "E31GpuXidError.md", "undrain", tmp_path, NODE=node)
    wait_for(lambda: _live(own, node), timeout_s=WAIT_S, what=f"{node} back in service")


@pytest.mark.timeout(STACK_TEST_TIMEOUT_S)
def test_gpu_ecc_errors_drain_holds_across_a_restart_until_undrained(
        own: OwnStack, tmp_path: Path) -> None:
    # Given a live node (the page's blocks take any node name: here a cpu worker)
    node = f"cpu0@{socket.gethostname()}"
    wait_for(lambda: _live(own, node), timeout_s=WAIT_S, what=f"{node} live")
    # When the operator drains it as E31GpuEccErrors.md says for the embedded stack
    out = _follow(own, "E31GpuEccErrors.md", "drain", tmp_path, NODE=node)
    assert "all drained" in out, out
    # and the stack's launcher is restarted (issue 32: the page said `e31 down` and
    # `e31 up -d` bring the node back; `e31 up`'s launcher keeps it drained)
    launcher = own.state()["children"]["worker"]
    log = own.home / "logs" / "worker.log"
    seen = len(log.read_bytes())
    os.kill(launcher, signal.SIGTERM)
    wait_for(lambda: f"worker_held_drained node={node}".encode() in log.read_bytes()[seen:],
             timeout_s=WAIT_S, what="the restarted launcher to hold the node drained")
    # Then the node stays out of service
    assert own.state()["children"]["worker"] != launcher
    assert not _live(own, node)
    # and the page's undrain puts it back
    _follow(own, "E31GpuEccErrors.md", "undrain", tmp_path, NODE=node)
    wait_for(lambda: _live(own, node), timeout_s=WAIT_S, what=f"{node} back in service")


@pytest.mark.timeout(STACK_TEST_TIMEOUT_S)
def test_scheduler_not_ticking_confirm(own: OwnStack, tmp_path: Path) -> None:
    # Given the stack's scheduler hung (stopped: `e31 up` restarts only one that exits) and
    # a job queued behind it
    scheduler = own.state()["children"]["scheduler"]
    os.kill(scheduler, signal.SIGSTOP)
    try:
        job = own.client().submit(command=["true"], resources={"gpus": 0}, name="unticked")
        client = redis.Redis.from_url(own.redis_url)
        try:
            wait_for(lambda: client.get(keys.LEADER) is None, timeout_s=WAIT_S,
                     what="the leader's key to lapse")
        finally:
            client.close()
        # When the operator confirms it as E31SchedulerNotTicking.md says
        out = _follow(own, "E31SchedulerNotTicking.md", "confirm", tmp_path,
                      E31_REDIS_URL=own.redis_url, COLUMNS="200")
        # Then the job's class shows it queued, and no scheduler leads (an empty GET)
        assert re.search(r"^ *cpu .* 1 +0 +\S+ *$", out, re.M), out
        assert not re.search(r"^[0-9a-f]{32}$", out, re.M), out   # no leader's token
        # and the job's status says so, where it said it waited for a free cpu slot
        status = job.status()
        assert (status["state"], status["pending"]["reason"]) == ("queued", "no_scheduler")
    finally:
        os.kill(scheduler, signal.SIGCONT)
    assert job.wait(timeout=WAIT_S)["state"] == "succeeded"


@pytest.mark.timeout(STACK_TEST_TIMEOUT_S)
def test_redis_restart(own: OwnStack, tmp_path: Path) -> None:
    # Given the stack's redis-server killed while `e31 up` is stopped (an outage that lasts)
    up, old = own.state()["pid"], own.state()["children"]["redis"]
    os.kill(up, signal.SIGSTOP)
    try:
        os.kill(old, signal.SIGKILL)
        wait_for(lambda: not process_alive(old), what="redis to die")
        # When the operator confirms it as E31BrokerErrors.md says
        [block] = doc(PAGES + "E31BrokerErrors.md").run_blocks("confirm")
        ran = run_block(block, env=_env(own, E31_REDIS_URL=own.redis_url), cwd=tmp_path)
    finally:
        os.kill(up, signal.SIGCONT)
    # Then `e31 top` and `e31 queue` say Redis is not answering, and redis-cli cannot connect
    # (its exit 1 ends the block)
    assert "workers unknown: Redis did not answer" in ran.output, ran.output
    assert "the broker (Redis) is unreachable" in ran.output, ran.output
    assert "Could not connect to Redis" in ran.output and ran.returncode == 1, ran.output
    # When `e31 up` runs again and the operator follows redis-restart.md's check
    out = _follow(own, "redis-restart.md", "verify", tmp_path)
    # Then a new redis-server serves the same URL, stack.json names it, and a job ran
    new = own.state()["children"]["redis"]
    assert new != old and process_alive(new)
    assert f"\n{new}\n" in f"\n{out}\n", out
    assert "\nPONG\n" in f"\n{out}\n", out    # redis-cli is let in (--user default)
    assert "succeeded" in out


@pytest.mark.timeout(STACK_TEST_TIMEOUT_S)
def test_database_migrations(own: OwnStack, tmp_path: Path) -> None:
    # Given the running stack (this test stops it, as the runbook does first)
    head = ScriptDirectory(str(MIGRATIONS_DIR)).get_current_head()
    block = doc(PAGES + "database-migrations.md").run_blocks("upgrade")[0]
    steps = console_steps(block)
    # The page shows the package's head, as the migration files say, twice
    assert [shown for command, shown in steps if "get_current_head" in command] == [[head]]
    for command, shown in steps:
        ran = run_command(command, env=_env(own), cwd=tmp_path)
        assert ran.returncode == 0, f"{block.where}: {command}\n{ran.output}"
        assert output_matches(shown, ran.output), f"{command}: {shown}\n{ran.output}"
    assert (tmp_path / "e31-before-upgrade.db").exists()


# --- on a stack of its own that may fetch from this machine, and gives up after two faults --

class Unavailable(Quiet):
    """An input server that is down: 503 for every path."""

    def do_GET(self) -> None:
        self.send_response(503)
        self.end_headers()


@pytest.mark.timeout(STACK_TEST_TIMEOUT_S)
def test_pool_faults_and_jobs_failed_by_pool_confirm(tmp_path: Path) -> None:
    # Given a job whose input server answers 503, on a pool that may fetch from loopback and
    # gives up after two faults of its own (E31_INFRA_RETRIES)
    with Serving(Unavailable) as server, own_stack(
            tmp_path / "home", "--cpu-slots", "1",
            E31_INPUT_ALLOWED_NETWORKS="127.0.0.0/8", E31_INFRA_RETRIES="2") as st:
        job = st.client().submit(command=["cat", "data.csv"], resources={"gpus": 0},
                                 inputs={"data": f"{server.base}/data.csv"}, name="fetcher")
        wait_for(lambda: job.status()["state"] == "failed", timeout_s=WAIT_S,
                 what="the pool to give up on the job")
        # When the operator confirms it as E31PoolFaults.md and E31JobsFailedByPool.md say
        faults = _follow(st, "E31PoolFaults.md", "confirm", tmp_path, JOB=job.id,
                         COLUMNS="400")
        failed = _follow(st, "E31JobsFailedByPool.md", "confirm", tmp_path, JOB=job.id,
                         COLUMNS="400")
    # Then the failed job shows with the pool's reason, each attempt's error names the URL
    # and the server's status, and its log says what the setup met
    for out in (faults, failed):
        assert re.search(rf"^{job.id} +fetcher +failed .* setup_transient *$", out, re.M), out
        assert "the pool failed this job: 2 faults of its own (infra_retries=2)" in out, out
        assert "e31: setup failed: inputs.data: cannot read " in out, out
        assert "503 Service Unavailable" in out, out


# --- on a private PostgreSQL that the test stops: the store outage ----------------------

@pytest.fixture
def pg_api(tmp_path: Path) -> Iterator[tuple[Cluster, Postgres]]:
    """The API alone (no scheduler or worker is needed to see the outage) over a PostgreSQL of
    the test's own: the machine's shared one is never stopped."""
    why = Postgres.available()
    if why:
        pytest.skip(why)
    pg = Postgres()
    pg.init()
    cluster = make_cluster(tmp_path / "home", database_url=pg.url)
    try:
        cluster.start(hosts=())
        yield cluster, pg
    finally:
        for proc in cluster.procs.values():   # nothing in a stop of the API is under test
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        cluster.stop()
        pg.destroy()


def _lines(block: Any) -> list[str]:
    return [line.strip() for line in block.text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


@pytest.mark.timeout(STACK_TEST_TIMEOUT_S)
def test_store_outage(pg_api: tuple[Cluster, Postgres], tmp_path: Path) -> None:
    cluster, pg = pg_api
    env = dict(cluster.env, E31_URL=cluster.url, E31_TOKEN=cluster.token, TOKEN=cluster.token,
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]))
    address = urlsplit(cluster.url).netloc
    outage = doc(PAGES + "store-outage.md")

    # Given the store stopped
    pg.stop()
    # When the operator asks the API, as the runbook's symptoms show: 503, Retry-After, why
    [symptoms] = outage.run_blocks("symptoms")
    for command, shown in console_steps(symptoms):
        ran = run_command(command.replace("localhost:8031", address), env=env, cwd=tmp_path)
        assert output_contains(shown, ran.output), f"{shown}\n{ran.output}"   # (and date, …)
    # and a change fails at once, exit 3, saying so (a read would retry for 60 s first)
    ran = run_command("e31 submit --gpus 0 -- true", env=env, cwd=tmp_path)
    assert ran.returncode == 3 and "error: results store unavailable: " in ran.output, ran.output
    # and the runbook's first step finds the database down
    for command in _lines(outage.run_blocks("find")[0]):
        ran = run_command(command, env=env, cwd=tmp_path)
        assert ran.returncode != 0, f"{command}\n{ran.output}"

    # When it is back (the runbook's step 2)
    pg.start()
    # Then step 1 finds it up, the API answers by itself, and no job stays running on an old
    # lease
    found = _follow_blocks(outage.run_blocks("find"), env, tmp_path)
    assert "accepting connections" in found, found
    wait_for(lambda: run_command("e31 ls", env=env, cwd=tmp_path).returncode == 0,
             timeout_s=WAIT_S, what="the API to answer again")
    verified = _follow_blocks(outage.run_blocks("verify"), env, tmp_path)
    assert "(0 rows)" in verified, verified


def _follow_blocks(blocks: list[Any], env: dict[str, str], cwd: Path) -> str:
    outputs = []
    for block in blocks:
        ran = run_block(block, env=env, cwd=cwd)
        assert ran.returncode == 0, f"{block.where} exited {ran.returncode}:\n{ran.output}"
        outputs.append(ran.output)
    return "\n".join(outputs)


# --- on a stack of its own whose E31_HOME is a small tmpfs the test fills: the full disk -----

DISK_SIZE = "64m"


def _fill(directory: Path) -> Path:
    """Write zeros to `directory/fill` until its filesystem has no space left."""
    fill = directory / "fill"
    chunk = b"\0" * (1 << 20)
    with open(fill, "wb") as f:
        with contextlib.suppress(OSError):       # ENOSPC: the point
            while True:
                f.write(chunk)
                f.flush()
    return fill


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB tmpfs, mounted for the test (root only) and unmounted after."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs to fill needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_SIZE}", "tmpfs",
                              str(disk)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.timeout(STACK_TEST_TIMEOUT_S)
def test_store_outage_full_disk(small_disk: Path, tmp_path: Path) -> None:
    shared = tmp_path / "shared"          # off the small disk: the test's signals to the job
    with own_stack(small_disk / "e31", "--cpu-slots", "1", "--simulate-gpus", "1x24",
                   shared=shared) as st:
        env = _env(st)
        children = st.state()["children"]
        wait_for(lambda: len(_beating(st)) >= 2, timeout_s=WAIT_S,
                 what="the GPU and CPU workers' heartbeats")
        beating = _beating(st)
        # Given a job running, which ends when told to, and the disk of E31_HOME full
        go, done, started = shared / "go", shared / "done", shared / "started"
        job = st.client().submit(
            command=["sh", "-c", f"touch {started}; while [ ! -e {go} ]; do sleep 0.1; done; "
                                 f"touch {done}"],
            resources={"gpus": 0}, name="through-the-outage")
        # (its command, not only its claim: an attempt set up on a full disk never starts)
        wait_for(started.exists, timeout_s=WAIT_S, what="the job's command to start")
        assert _running(job)
        fill = _fill(small_disk)
        # When a user submits: refused at once, exit 3, saying why (the runbook's symptom)
        ran = run_command("e31 submit --gpus 0 -- true", env=env, cwd=tmp_path)
        assert ran.returncode == 3, ran.output
        assert "error: results store unavailable: database or disk is full" in ran.output
        # but reads still answer (SQLite reads need no space), as the embedded section says
        ran = run_command("e31 ls", env=env, cwd=tmp_path)
        assert ran.returncode == 0 and "running" in ran.output, ran.output
        # and a job that ends during the outage is not recorded yet: its worker's write waits
        go.touch()
        wait_for(done.exists, timeout_s=WAIT_S, what="the job's command to end")
        assert _running(job)
        # (an outage longer than the 8 s after which, before the heartbeat thread's fix, the
        # GPU workers' heartbeats were gone for good: issue 32)
        time.sleep(10)

        # When the operator frees the space and follows the embedded section's steps
        fill.unlink()
        out = _follow(st, "store-outage.md", "embedded", tmp_path)
        # Then df shows the disk of E31_HOME, and a submission is taken and runs again
        assert str(small_disk) in out and re.search(r"^j-\w+ succeeded:", out, re.M), out
        # and the job that ended during the outage is recorded by its worker's retry
        assert job.wait(timeout=WAIT_S)["state"] == "succeeded"
        # and every process of the stack lived through it (none needed `e31 up`'s restart)
        assert st.state()["children"] == children
        assert all(process_alive(pid) for pid in children.values())
        # and every worker beats again, the GPU worker's included ("the processes recover")
        wait_for(lambda: _beating(st) >= beating, timeout_s=WAIT_S,
                 what=f"the heartbeats of {sorted(beating)} back")
