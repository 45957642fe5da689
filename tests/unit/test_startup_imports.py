"""What the processes of `e31 up` and `e31 down` import before they do their work (issue 32,
rough edge 16: `e31 up -d` took 41 s to be ready and `e31 down` up to 24 s on a 2-core machine,
every process of the stack importing at once). `e31 down` reads a pid and signals it; the
worker launcher starts processes and watches them: neither needs Celery, and `down` needs no
Redis, store or HTTP client. Read from `python -X importtime`, in a fresh interpreter each."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def imported(*argv: str, env: dict[str, str] | None = None) -> set[str]:
    """The top-level packages a fresh `python -X importtime ARGV` imported."""
    done = subprocess.run([sys.executable, "-X", "importtime", *argv], capture_output=True,
                          text=True, timeout=60, env=env, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return {line.rsplit("|", 1)[1].strip().split(".")[0] for line in done.stderr.splitlines()
            if line.startswith("import time:") and "|" in line}


def test_e31_down_imports_no_redis_store_or_http_client(tmp_path: Path) -> None:
    # Given a home no stack runs from, When `e31 down` runs
    env = {k: v for k, v in os.environ.items() if not k.startswith("E31_")}
    loaded = imported("-m", "e31.cli", "down", env={**env, "E31_HOME": str(tmp_path)})

    # Then it read the state file with none of the stack's heavy imports
    assert "typer" in loaded        # the timing is read: the CLI was imported
    assert not loaded & {"redis", "sqlalchemy", "httpx", "alembic", "celery"}, loaded


def test_the_worker_launcher_imports_no_celery() -> None:
    # When the launcher's module is imported (as `e31 worker` does before its first worker)
    loaded = imported("-c", "import e31_worker.node.launcher")

    # Then Celery, which only its worker processes run, is not among its imports
    assert "e31_worker" in loaded
    assert not loaded & {"celery", "kombu"}, loaded
