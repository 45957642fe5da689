"""The same processes around PostgreSQL, as at scale: `e31 up` migrates it and a job runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from e31.client import Client
from e31.local.redisserver import free_port
from e31.local.state import stack_ready
from tests.conftest import fresh_postgres_database, wait_for


@pytest.fixture
def postgres_url() -> Iterator[str]:
    with fresh_postgres_database() as url:
        yield url


def test_a_stack_on_postgresql_runs_a_gpu_job_and_bills_it(
        postgres_url: str, tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("E31_")}
    env.update(E31_HOME=str(home), E31_DATABASE_URL=postgres_url, E31_API_PORT=str(free_port()),
               E31_HEARTBEAT_INTERVAL_S="0.5")
    home.mkdir()
    up = subprocess.Popen([sys.executable, "-m", "e31.cli", "up", "--simulate-gpus", "1x80",
                           "--cpu-slots", "0", "--no-flower"], env=env,
                          stdout=open(tmp_path / "up.out", "w"), stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: up.poll() is not None or stack_ready(home), timeout_s=120, poll_s=0.2,
                 what="e31 up on PostgreSQL")
        assert up.poll() is None, (tmp_path / "up.out").read_text()
        profile = json.loads((home / "profile.json").read_text())
        client = Client(profile["url"], profile["token"])

        status = client.submit(entrypoint="e31_worker.examples:hello", params={"name": "pg"},
                               resources={"gpu_mem_gb": 48}).wait(timeout=60)

        assert status["result"]["greeting"] == "hello, pg"
        assert status["attempts"][0]["worker"].startswith("gpu0@")   # gpu80 spills to gpu48
        engine = create_engine(postgres_url)
        with engine.connect() as conn:
            billed = conn.execute(text("SELECT gpu_seconds FROM jobs WHERE id = :id"),
                                  {"id": status["id"]}).scalar_one()
        engine.dispose()
        assert billed == pytest.approx(status["gpu_seconds"], abs=0.01) and billed > 0
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=60)
