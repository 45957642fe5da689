"""`celery -A e31.app …` against a real `e31 up` stack: the operator's own Celery tools reach
the pool's workers from the same settings as every process (docs/operations.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.docblocks import doc, run_block
from tests.e2e.conftest import Stack

STACK_WORKERS = 4   # the stack's simulated GPUs 0 and 1, and its two cpu slots


def _celery(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    # No E31_REDIS_URL in the stack's environment: e31.app finds the Redis of the `e31 up`
    # running from E31_HOME, as `e31 worker --drain` does.
    return subprocess.run([sys.executable, "-m", "celery", "-A", "e31.app", *args],
                          env=stack.env, capture_output=True, text=True, timeout=60)


def test_celery_inspect_ping_through_e31_app_is_answered_by_every_worker(stack: Stack) -> None:
    # When an operator pings the pool through the importable app
    proc = _celery(stack, "inspect", "ping", "--timeout", "5")
    # Then every worker of the stack answers pong
    assert proc.returncode == 0, proc.stderr
    answered = sorted(line.split()[1].split("@")[0] for line in proc.stdout.splitlines()
                      if line.startswith("->") and line.rstrip().endswith("OK"))
    assert answered == ["cpu0", "cpu1", "gpu0", "gpu1"]
    assert f"{STACK_WORKERS} nodes online" in proc.stdout


def test_celery_inspect_active_through_e31_app_lists_each_worker(stack: Stack) -> None:
    proc = _celery(stack, "inspect", "active", "--timeout", "5")
    assert proc.returncode == 0, proc.stderr
    assert f"{STACK_WORKERS} nodes online" in proc.stdout


def test_importing_e31_app_builds_nothing_until_the_app_is_asked_for() -> None:
    # Given an environment with no pool at all
    code = "import e31.app, sys; print('celery' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "E31_HOME": "/nonexistent"}, timeout=60)
    # Then the import succeeds without reading settings or loading Celery
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def test_the_operations_pages_celery_commands_run_against_the_pool(stack: Stack,
                                                                   tmp_path: Path) -> None:
    [block] = doc("docs/operations.md").run_blocks("celery")
    path = f"{Path(sys.executable).parent}:{stack.env.get('PATH', '')}"   # celery, as installed
    ran = run_block(block, env=dict(stack.env, PATH=path), cwd=tmp_path)
    assert ran.returncode == 0, ran.output
    assert ran.output.count(f"{STACK_WORKERS} nodes online") == 2, ran.output
