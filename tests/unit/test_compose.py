"""docker-compose.yml: the services of the design, one worker pinned per GPU; valid for compose."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

COMPOSE = Path(__file__).parents[2] / "docker-compose.yml"


def test_compose_has_every_service_and_pins_one_gpu_per_worker() -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    assert {"redis", "postgres", "api", "scheduler", "flower"} <= set(services)
    gpu_workers = {name: s for name, s in services.items() if name.startswith("worker-gpu")}
    assert len(gpu_workers) >= 1
    pinned = []
    for service in gpu_workers.values():
        [device] = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and len(device["device_ids"]) == 1
        pinned.append(device["device_ids"][0])
    assert len(set(pinned)) == len(pinned), "two workers share a GPU"


def test_flower_is_published_on_loopback_only() -> None:
    flower = yaml.safe_load(COMPOSE.read_text())["services"]["flower"]
    assert all(str(p).startswith("127.0.0.1:") for p in flower.get("ports", []))


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
def test_docker_compose_accepts_the_file() -> None:
    result = subprocess.run(["docker-compose", "-f", str(COMPOSE), "config", "-q"],
                            env=dict(os.environ, E31_FLOWER_PASSWORD="x"), capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
