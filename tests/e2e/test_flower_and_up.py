"""Flower on the stack's broker, and `e31 up -d` / `e31 down` as a user runs them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from e31.local.redisserver import free_port
from tests.conftest import process_alive, wait_for

from .conftest import Stack

WAIT_S = 90


def test_flower_shows_jobs_as_tenant_and_name_behind_basic_auth(stack: Stack) -> None:
    port = free_port()
    env = stack.env_with_redis(E31_FLOWER_PORT=str(port), E31_FLOWER_PASSWORD="s3cret")
    log = open(stack.home / "logs" / "flower-test.log", "ab")
    flower = subprocess.Popen([sys.executable, "-m", "e31.cli", "flower"], env=env, stdout=log,
                              stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _answers(f"{base}/healthcheck"), timeout_s=WAIT_S, what="Flower")
        assert httpx.get(f"{base}/api/workers").status_code == 401
        assert httpx.get(f"{base}/metrics").status_code == 200   # why it must stay private

        job = stack.client().submit(entrypoint="e2ejobs:where", resources={"gpus": 0},
                                    name="seen-in-flower")
        job.wait(timeout=WAIT_S)

        def named() -> bool:
            tasks = httpx.get(f"{base}/api/tasks", auth=("e31", "s3cret")).json()
            return any(t.get("name") == "default/seen-in-flower" and t.get("state") == "SUCCESS"
                       for t in tasks.values())
        wait_for(named, timeout_s=WAIT_S, what="the job in Flower under tenant/name")
    finally:
        flower.send_signal(signal.SIGTERM)
        flower.wait(timeout=30)


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


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
