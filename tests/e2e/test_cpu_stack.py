"""A CPU-only `e31 up --cpu-slots 2` of its own, as a new user starts one (issue 32): `e31 queue`
counts the CPU slots a tenant's running job holds, and the supervisor gives a restarted API the
environment it started with, so /metrics still wants the metrics token after the API died."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from e31.client import JobHandle
from tests.conftest import process_alive, wait_for

from .stacks import OwnStack, own_stack

WAIT_S = 60
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cpu_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OwnStack]:
    with own_stack(tmp_path_factory.mktemp("cpuhome"), "--cpu-slots", "2") as st:
        yield st


def running(job: JobHandle) -> bool:
    return job.status()["state"] == "running"


def row_of(table: str, first: str) -> list[str]:
    """The words of the table's line whose first word is `first` (its rules left out)."""
    rows = [[w for w in line.split() if w not in "│┃"] for line in table.splitlines()]
    return next((r for r in rows if r[:1] == [first]), [table])


def test_queue_counts_the_cpu_slot_a_tenants_running_job_holds(cpu_stack: OwnStack) -> None:
    # Given a CPU job of the stack's tenant running on one of its two CPU slots
    job = cpu_stack.client().submit(command=["sleep", "120"], resources={"gpus": 0},
                                    name="cpu-hold")
    try:
        wait_for(lambda: running(job), timeout_s=WAIT_S, what="the CPU job to run")

        # When the user asks how the queue stands
        shown = cpu_stack.e31("queue")
        view: dict[str, Any] = cpu_stack.client().queue()
    finally:
        job.cancel()

    # Then the cpu class shows its two slots, one busy, and the tenant running 1 (it read 0:
    # the column counted GPUs, and a CPU job holds none)
    assert shown.returncode == 0, shown.stderr
    assert row_of(shown.stdout, "cpu")[:8] == ["cpu", "2", "CPU", "1", "0", "default", "0",
                                               "1"], shown.stdout
    assert row_of(shown.stdout, "class")[:8] == ["class", "slots", "busy", "queued", "tenant",
                                                 "queued", "running", "used"]
    [cpu] = [c for c in view["classes"] if c["size_class"] == "cpu"]
    [tenant] = cpu["tenants"]
    assert (tenant["tenant"], tenant["running"], tenant["running_gpus"]) == ("default", 1, 0)
    assert tenant["used_share"] == 1.0


def test_an_api_the_supervisor_restarts_keeps_its_metrics_token(cpu_stack: OwnStack) -> None:
    # Given the stack's /metrics, which wants the token `e31 up` keeps in metrics.token
    token = (cpu_stack.home / "metrics.token").read_text().strip()
    metrics = f"{cpu_stack.url}/metrics"
    assert httpx.get(metrics, timeout=30).status_code == 401
    assert httpx.get(metrics, headers=bearer(token), timeout=30).status_code == 200

    # When the API process dies (SIGKILL) and `e31 up` starts it again
    old = cpu_stack.state()["children"]["api"]
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: cpu_stack.state()["children"]["api"] != old, timeout_s=WAIT_S,
             what="the supervisor to restart the API")
    new = cpu_stack.state()["children"]["api"]
    wait_for(lambda: answers(f"{cpu_stack.url}/v1/health"), timeout_s=WAIT_S,
             what="the restarted API to answer")

    # Then the new API has the metrics token too: a scrape with it is answered, and one
    # without it is still refused (restarted with the others' environment, the API had no
    # token and answered any loopback scrape, and a remote scraper's token was refused)
    assert process_alive(new) and not process_alive(old)
    assert httpx.get(metrics, headers=bearer(token), timeout=30).status_code == 200
    assert httpx.get(metrics, timeout=30).status_code == 401


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False
