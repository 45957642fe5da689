"""No thread of a worker dies alone (issue 27; docs/reliability.md, "Threads"): each thread a
worker process starts is given an exception it did not foresee, and either goes on (the
log pump, the background upload; the heartbeat's own test is in test_watchdog.py) or ends
the process for its launcher to restart (any other thread); the lease keeper and the GPU
readings, not threads, survive a failure in the supervisor's tick.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis

from e31.core import keys
from e31.core.records import Renewal
from e31.ops.heartbeat import GpuSample, WorkerInfo
from e31_worker.attempt import logpump, shipping, watchdog
from e31_worker.attempt.notes import PendingNote
from e31_worker.attempt.plan import Directive
from e31_worker.node.exits import EXIT_THREAD_DIED
from e31_worker.node.heartbeat import Heartbeat

OUTPUT_LINES = 20_000      # about 1.4 MB: twenty times what a pipe holds
WAIT_S = 30


def raising_once(real: Callable[..., Any], exc: BaseException) -> Callable[..., Any]:
    """`real`, except that its first call raises `exc`; `calls` counts them all."""
    def patched(*args: Any, **kwargs: Any) -> Any:
        patched.calls += 1  # type: ignore[attr-defined]
        if patched.calls == 1:  # type: ignore[attr-defined]
            raise exc
        return real(*args, **kwargs)
    patched.calls = 0  # type: ignore[attr-defined]
    return patched


@pytest.fixture
def thread_deaths(monkeypatch: pytest.MonkeyPatch) -> list[threading.ExceptHookArgs]:
    """The threads that die of an exception during the test (none should)."""
    died: list[threading.ExceptHookArgs] = []
    monkeypatch.setattr(threading, "excepthook", died.append)
    return died


def test_the_log_pump_reads_on_after_a_failed_write_and_the_child_never_blocks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        thread_deaths: list[threading.ExceptHookArgs]) -> None:
    # Given a log pump whose first write to the log fails (a full disk's ENOSPC)
    monkeypatch.setattr(logpump, "_append", raising_once(
        logpump._append, OSError(28, "No space left on device")))
    child = subprocess.Popen(
        [sys.executable, "-c", f"for i in range({OUTPUT_LINES}): print(f'line {{i:06d}}' * 8)"],
        stdout=subprocess.PIPE)
    assert child.stdout is not None
    log_path = tmp_path / "attempt.log"
    done = threading.Event()
    pump = threading.Thread(target=logpump.pump_log, name="log-test", daemon=True,
                            args=(child.stdout.fileno(), log_path, 10 ** 9, "cut\n", done))

    # When its child writes far more than a pipe holds
    with caplog.at_level(logging.WARNING, logger=logpump.__name__):
        pump.start()
        child.wait(timeout=WAIT_S)
        pump.join(timeout=WAIT_S)

    # Then the child ran to its end, the pump too, and the log holds what came after the fault
    assert child.returncode == 0 and not pump.is_alive() and thread_deaths == []
    assert f"line {OUTPUT_LINES - 1:06d}" in log_path.read_text()
    assert "log_pump_error" in caplog.text
    child.stdout.close()


def test_a_background_upload_that_raises_is_logged_and_the_next_beat_uploads_again(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        thread_deaths: list[threading.ExceptHookArgs]) -> None:
    # Given a shipper whose first log copy raises what it did not foresee
    shipped: list[str] = []
    monkeypatch.setattr(shipping.Shipper, "ship_log", raising_once(
        lambda self: shipped.append("log"), OSError(5, "Input/output error")))
    monkeypatch.setattr(shipping.Shipper, "ship_checkpoints",
                        lambda self: shipped.append("checkpoints"))
    shipper = shipping.Shipper(SimpleNamespace(), SimpleNamespace(job_id="j1"),  # type: ignore[arg-type]
                               SimpleNamespace())  # type: ignore[arg-type]

    # When two beats each start a copy
    with caplog.at_level(logging.WARNING, logger=shipping.__name__):
        shipper.poke()
        shipper.finish()
        shipper.poke()
        shipper.finish()

    # Then the failed one said so and still copied the checkpoints; the next copied both
    assert thread_deaths == []
    assert "ship_error job=j1" in caplog.text
    assert shipped == ["checkpoints", "log", "checkpoints"]


def lease_keeper(poke: Callable[[], None]) -> watchdog.LeaseKeeper:
    """A lease keeper whose store renews every time, and whose shipper's `poke` is `poke`."""
    svc = SimpleNamespace(
        repo=SimpleNamespace(renew=lambda *a, **k: Renewal(ours=True, cancel=False,
                                                           preempt=False)),
        settings=SimpleNamespace(lease_ttl_s=10.0), draining=threading.Event())
    return watchdog.LeaseKeeper(svc, SimpleNamespace(job_id="j1", token=1, attempt=1),  # type: ignore[arg-type]
                                SimpleNamespace(poke=poke),  # type: ignore[arg-type]
                                PendingNote("j1", 1))


def test_the_lease_keeper_keeps_the_lease_when_its_upload_cannot_start(
        caplog: pytest.LogCaptureFixture) -> None:
    # Given a lease keeper whose background upload fails to start once (no thread to be had)
    pokes: list[int] = []
    keeper = lease_keeper(raising_once(lambda: pokes.append(1),
                                       RuntimeError("can't start new thread")))

    # When the supervisor ticks twice
    with caplog.at_level(logging.ERROR, logger=watchdog.__name__):
        first, second = keeper(None), keeper(None)

    # Then the job goes on, and the next beat's upload starts
    assert (first, second) == (Directive.CONTINUE, Directive.CONTINUE)
    assert pokes == [1] and "ship_not_started job=j1" in caplog.text


class FlakyGpus:
    """GPU readings that fail once (NVML, or a full disk under the gang ledger), then read
    one idle GPU."""

    def __init__(self) -> None:
        self.sample = raising_once(lambda shown: (GpuSample(index=0, util_pct=0.0),),
                                   OSError(28, "No space left on device"))


def test_a_gpu_reading_that_fails_in_the_watchdog_neither_stops_nor_idles_the_job(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Given a watchdog with `on_idle: kill` after 1 s, whose first GPU reading fails
    now = [0.0]
    flags: list[object] = []
    dog = watchdog.Watchdog(job_id="j1", attempt=1, log_path=tmp_path / "attempt.log",
                            log_room_bytes=1024, gpus=FlakyGpus(),  # type: ignore[arg-type]
                            idle_timeout_s=1, kill=True,
                            flag=lambda since: flags.append(since) or True,
                            clock=lambda: now[0])

    # When it looks at a job without output after 2 s (the reading fails), then 0.5 s later
    now[0] = 2.0
    with caplog.at_level(logging.WARNING, logger=watchdog.__name__):
        first = dog.observe(None)
    now[0] = 2.5
    second = dog.observe(None)

    # Then neither look stops it: the failed one counts as work (it could not see), and
    # the idle clock runs from there
    assert (first, second) == (Directive.CONTINUE, Directive.CONTINUE) and flags == []
    assert "gpu_sample_failed job=j1" in caplog.text
    # And once idle for its timeout after that, the job is stopped as before
    now[0] = 3.5
    assert dog.observe(None) is Directive.IDLE


THREAD_DIES = """
import threading, time
from e31_worker.node.celery_process import end_on_thread_death
threading.excepthook = end_on_thread_death
def beat():
    raise OSError(28, "No space left on device")
threading.Thread(target=beat, name="e31-test-thread").start()
time.sleep(30)   # the main thread would serve on: the process must end without it
"""


def test_a_thread_that_dies_of_an_unforeseen_exception_ends_the_worker_process() -> None:
    # Given a worker process's thread hook, and a thread of it that raises
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", THREAD_DIES], capture_output=True, text=True,
                          timeout=WAIT_S, check=False)

    # Then the process ends at once with the code its launcher restarts on, and says why
    assert done.returncode == EXIT_THREAD_DIED
    assert time.monotonic() - started < WAIT_S / 2
    assert "worker_thread_died thread=e31-test-thread: OSError" in done.stderr
    assert "No space left on device" in done.stderr


def test_a_stopping_worker_beats_with_its_job_until_it_is_handed_back(
        redis_client: redis.Redis) -> None:
    # Given a worker's heartbeat while it runs a job
    node = "gpu0@stopping-test"
    beat = Heartbeat(redis_client=redis_client,
                     identity=WorkerInfo(node=node, queues=("e31.gpu24",), gpus="0"),
                     interval_s=0.05, on_drain=lambda: None, drain_authorized=lambda: False)
    beat.start()
    beat.set_busy("j1")
    try:
        # When the worker is told to stop (SIGTERM: its job gets its grace, then is handed back)
        beat.stop()
        time.sleep(0.3)

        # Then it still beats with the job, so the scheduler does not take it for dead
        raw = redis_client.get(keys.worker(node))
        assert raw is not None and json.loads(raw)["busy_job"] == "j1"
        assert beat.draining.is_set()

        # And once the job is handed back, the heartbeat is withdrawn for good
        beat.set_busy(None)
        time.sleep(0.3)
        assert redis_client.get(keys.worker(node)) is None
    finally:
        beat.set_busy(None)
