"""Flower on the stack's broker, and `e31 up -d` / `e31 down` as a user runs them."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlsplit

import httpx
import pytest
import redis

from e31.core import keys
from e31.local.redisserver import free_port, start_redis
from e31.ops.drain import request_drain
from e31.store import Repo, make_engine
from tests.conftest import process_alive, wait_for

from .conftest import Stack
from .stacks import OwnStack, own_stack

WAIT_S = 90
FLOWER_LOGIN = ("e31", "s3cret")   # E31_FLOWER_USER's default and the password set below


def test_flower_shows_jobs_as_tenant_and_name_behind_basic_auth(stack: Stack) -> None:
    port = free_port()
    env = stack.env_with_redis(E31_FLOWER_PORT=str(port), E31_FLOWER_PASSWORD="s3cret")
    log = open(stack.home / "logs" / "flower-test.log", "ab")
    flower = subprocess.Popen([sys.executable, "-m", "e31.cli", "flower"], env=env, stdout=log,
                              stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _answers(f"{base}/healthcheck", auth=FLOWER_LOGIN), timeout_s=WAIT_S,
                 what="Flower")
        # every route asks for the login, its metrics and health too (e31.edge.flowerauth)
        for route in ("/api/workers", "/metrics", "/healthcheck"):
            assert httpx.get(f"{base}{route}").status_code == 401, route
        # Flower answers before its event receiver has bound its queue, and a task event sent
        # before then is gone (a fanout exchange keeps nothing): wait until it has heard a
        # worker's heartbeat, so the job's events below are ones it receives.
        wait_for(lambda: _heard_a_worker(f"{base}/metrics"), timeout_s=WAIT_S,
                 what="Flower to receive a worker heartbeat event")

        # Task events are fire and forget: those sent while Flower's receiver reconnects (it
        # logs "Failed to capture events" and backs off) are gone for it, as for any monitor of
        # Celery's events. A job it missed is followed by another, three at most: a name the
        # platform did not give never shows, however many.
        def tasks() -> dict[str, dict]:
            return httpx.get(f"{base}/api/tasks", auth=FLOWER_LOGIN).json()

        def evidence() -> str:
            ours = [t for t in tasks().values() if "seen-in-flower" in str(t.get("name"))
                    or t.get("state") == "SUCCESS"][-5:]
            flower_log = (stack.home / "logs" / "flower-test.log").read_text(errors="replace")
            return f"tasks: {ours}\nFlower's log: {flower_log[-3000:]}"

        for n in range(3):
            name = f"seen-in-flower-{n}"
            job = stack.client().submit(entrypoint="e2ejobs:where", resources={"gpus": 0},
                                        name=name)
            job.wait(timeout=WAIT_S)
            try:
                wait_for(lambda name=name: any(
                    t.get("name") == f"default/{name}" and t.get("state") == "SUCCESS"
                    for t in tasks().values()), timeout_s=WAIT_S / 3,
                    what="the job in Flower under tenant/name", evidence=evidence)
                break
            except AssertionError:
                if n == 2:
                    raise
    finally:
        flower.send_signal(signal.SIGTERM)
        flower.wait(timeout=30)


def _heard_a_worker(metrics_url: str) -> bool:
    text = httpx.get(metrics_url, auth=FLOWER_LOGIN).text
    return any(line.startswith("flower_worker_online{") and line.endswith(" 1.0")
               for line in text.splitlines())


def test_up_detached_then_down_stops_every_process_it_started(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("E31_")}
    env.update(E31_HOME=str(tmp_path / "home"), E31_API_PORT=str(free_port()),
               E31_FLOWER_PORT=str(free_port()))
    up = subprocess.run([sys.executable, "-m", "e31.cli", "up", "-d", "--cpu-slots", "1"],
                        env=env, capture_output=True, text=True, timeout=180)
    assert up.returncode == 0, up.stderr + (tmp_path / "home" / "logs" / "up.log").read_text()
    assert "E31 Batch is ready: API http://127.0.0.1:" in up.stdout
    state = json.loads((tmp_path / "home" / "stack.json").read_text())
    pids = [state["pid"], *state["children"].values()]
    assert set(state["children"]) == {"api", "scheduler", "worker", "flower", "redis"}

    submitted = subprocess.run([sys.executable, "-m", "e31.cli", "submit", "--gpus", "0", "--wait",
                                "--", "echo", "from-up"], env=env, capture_output=True, text=True,
                               timeout=120)
    assert submitted.returncode == 0, submitted.stderr

    down = subprocess.run([sys.executable, "-m", "e31.cli", "down"], env=env, capture_output=True,
                          text=True, timeout=180)
    assert down.returncode == 0 and "stopped" in down.stdout
    for pid in pids:
        wait_for(lambda pid=pid: not process_alive(pid), timeout_s=30, what=f"pid {pid} to exit")


def _answers(url: str, auth: tuple[str, str] | None = None) -> bool:
    try:
        return httpx.get(url, auth=auth, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


# --- Drain and Redis on `e31 up` (issue 17): a stack of its own, which these tests break ---

@pytest.fixture(scope="module")
def up_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OwnStack]:
    with own_stack(tmp_path_factory.mktemp("uphome"), "--cpu-slots", "2") as st:
        yield st


def _live(st: OwnStack, node: str) -> bool:
    client = redis.Redis.from_url(st.redis_url)
    try:
        return client.get(keys.worker(node)) is not None
    finally:
        client.close()


def _worker_log(st: OwnStack) -> str:
    return (st.home / "logs" / "worker.log").read_text()


def test_drain_on_up_finds_its_redis_and_says_drained_only_once_the_job_is_requeued(
        up_stack: OwnStack) -> None:
    st = up_stack
    assert "E31_REDIS_URL" not in st.env           # as an operator's shell on the machine
    # A job that ignores SIGTERM: it runs the whole kill grace after its worker dropped its
    # heartbeat, the window in which "all drained" used to be printed too early.
    job = st.client().submit(command=["sh", "-c", "trap '' TERM; sleep 300"],
                             resources={"gpus": 0}, name="drained")
    wait_for(lambda: job.status()["state"] == "running", timeout_s=WAIT_S, what="the job to run")
    node = job.status()["attempts"][-1]["worker"]

    drained = st.e31("worker", "--drain", "--node", node, timeout_s=120)
    status = job.status()

    assert drained.returncode == 0, drained.stdout + drained.stderr
    assert f"drain requested: {node}" in drained.stdout
    assert "all drained" in drained.stdout
    assert status["attempts"][0]["reason"] == "drained"
    assert not (status["state"] == "running" and status["attempts"][-1]["worker"] == node)
    job.cancel()

    undrained = st.e31("worker", "--undrain", "--node", node)
    assert undrained.returncode == 0, undrained.stderr
    assert f"undrained: {node}" in undrained.stdout
    wait_for(lambda: _live(st, node), timeout_s=WAIT_S, what=f"{node} back in service")


def test_a_drained_node_stays_drained_when_up_restarts_the_launcher_until_undrained(
        up_stack: OwnStack) -> None:
    st = up_stack
    host = socket.gethostname()
    operator_drained, gpu_error_drained = f"cpu0@{host}", f"cpu1@{host}"
    wait_for(lambda: _live(st, operator_drained) and _live(st, gpu_error_drained),
             timeout_s=WAIT_S, what="both nodes live")
    # An operator drains one node; the other takes itself out, as a GPU's XID error does
    # (the worker records its own request, with the reason, in the store).
    drained = st.e31("worker", "--drain", "--node", operator_drained)
    assert drained.returncode == 0, drained.stdout + drained.stderr
    repo = Repo(make_engine(f"sqlite:///{st.home / 'e31.db'}"), half_life_s=3600.0)
    try:
        request_drain(redis.Redis.from_url(st.redis_url), repo, [gpu_error_drained],
                      reason="GPU 0 reported XID 79")
        wait_for(lambda: not _live(st, gpu_error_drained), timeout_s=WAIT_S,
                 what="the XID node to drain")
        launcher = st.state()["children"]["worker"]
        log_before = len(_worker_log(st))

        os.kill(launcher, signal.SIGKILL)             # `e31 up` restarts its launcher

        wait_for(lambda: st.state()["children"]["worker"] != launcher, timeout_s=WAIT_S,
                 what="e31 up to restart the launcher")
        for node in (operator_drained, gpu_error_drained):
            wait_for(lambda node=node: f"worker_held_drained node={node}"
                     in _worker_log(st)[log_before:], timeout_s=WAIT_S,
                     what=f"the restarted launcher to hold {node}")
            assert not _live(st, node)
        assert {d.node for d in repo.drained_nodes()} == {operator_drained, gpu_error_drained}
    finally:
        repo.engine.dispose()

    undrained = st.e31("worker", "--undrain")            # every drained node of this host
    assert undrained.returncode == 0, undrained.stderr
    for node in (operator_drained, gpu_error_drained):
        wait_for(lambda node=node: _live(st, node), timeout_s=WAIT_S, what=f"{node} back")
    done = st.e31("submit", "--gpus", "0", "--wait", "--", "echo", "after-undrain",
                  timeout_s=120)
    assert done.returncode == 0, done.stderr


def test_up_restarts_its_redis_on_the_same_url_and_the_pool_carries_on(
        up_stack: OwnStack) -> None:
    st = up_stack
    url, old = st.redis_url, st.state()["children"]["redis"]

    os.kill(old, signal.SIGKILL)

    def restarted() -> int | None:
        pid = st.state()["children"].get("redis")
        return pid if pid not in (None, old) and process_alive(pid) else None
    new = wait_for(restarted, timeout_s=WAIT_S, what="stack.json to name a live new redis")
    assert st.redis_url == url
    assert redis.Redis.from_url(url).info("server")["process_id"] == new  # same port, password
    done = st.e31("submit", "--gpus", "0", "--wait", "--", "echo", "after-redis",
                  timeout_s=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert all(process_alive(pid) for pid in st.state()["children"].values())


def test_down_stops_a_redis_restarted_by_hand_on_the_stacks_port(
        up_stack: OwnStack, tmp_path: Path) -> None:
    st = up_stack
    state = st.state()
    where = urlsplit(st.redis_url)
    os.kill(state["pid"], signal.SIGSTOP)    # so the operator's restart comes first
    try:
        os.kill(state["children"]["redis"], signal.SIGKILL)
        wait_for(lambda: not process_alive(state["children"]["redis"]), what="redis to die")
        hand, _ = start_redis(tmp_path / "redis", port=where.port,
                              password=unquote(where.password or ""))
    finally:
        os.kill(state["pid"], signal.SIGCONT)
    threading.Thread(target=hand.wait, daemon=True).start()   # reaped as soon as it exits
    wait_for(lambda: st.state()["children"].get("redis") == hand.pid, timeout_s=WAIT_S,
             what="e31 up to adopt the hand-restarted redis")

    down = st.e31("down", timeout_s=180)

    assert down.returncode == 0, down.stderr
    wait_for(lambda: not process_alive(hand.pid), timeout_s=30,
             what="the hand-restarted redis to be stopped")
