"""The attempt's watchdog (`e31_worker.attempt.watchdog`) on a clock the test turns: what
counts as work (log, progress, GPU utilisation), when a job is flagged, cleared and stopped,
and the GPU use it adds up."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest

from e31.ops.heartbeat import GpuSample
from e31_worker.attempt.plan import Directive
from e31_worker.attempt.watchdog import GpuUse, Watchdog
from e31_worker.node.telemetry import GpuMonitor, SimulatedSource

GIB = 1024 ** 3


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Gpus:
    """A GPU sampler whose readings the test sets."""

    def __init__(self, util_pct: float = 0.0, used_gb: float = 0.0) -> None:
        self.util_pct, self.used_gb = util_pct, used_gb
        self.asked: list[bool | None] = []

    def sample(self, job_active: bool | None) -> tuple[GpuSample, ...]:
        self.asked.append(job_active)
        return (GpuSample(index=0, util_pct=self.util_pct, mem_used_bytes=int(self.used_gb * GIB),
                          mem_total_bytes=80 * GIB),)


class Harness:
    def __init__(self, tmp_path: Path, *, timeout_s: int | None = 10, kill: bool = False,
                 gpus: object = None, room: int = 1 << 20) -> None:
        self.log = tmp_path / "attempt.log"
        self.log.write_text("e31: setup output\n")     # before the child: no sign of work
        self.clock = Clock()
        self.flags: list[datetime | None] = []
        self.store_up = True
        self.dog = Watchdog(job_id="j-1", attempt=1, log_path=self.log, log_room_bytes=room,
                            gpus=gpus, idle_timeout_s=timeout_s,  # type: ignore[arg-type]
                            kill=kill, flag=self._flag, clock=self.clock)

    def _flag(self, since: datetime | None) -> bool:
        if self.store_up:
            self.flags.append(since)
        return self.store_up

    def tick(self, after_s: float, progress: tuple[float, float] | None = None,
             output: str = "") -> Directive:
        self.clock.now += after_s
        if output:
            with open(self.log, "a") as f:
                f.write(output)
        return self.dog.observe(progress)


def test_a_job_without_any_sign_of_work_is_flagged_once_its_idle_timeout_passed(
        tmp_path: Path) -> None:
    h = Harness(tmp_path, timeout_s=10)
    assert h.tick(5) is Directive.CONTINUE and h.flags == []
    assert h.tick(5) is Directive.CONTINUE          # flag only: it keeps running
    assert len(h.flags) == 1 and h.flags[0] is not None
    h.tick(5)
    assert len(h.flags) == 1                          # flagged once, not every beat


def test_output_progress_or_a_busy_gpu_each_count_as_work(tmp_path: Path) -> None:
    gpus = Gpus()
    h = Harness(tmp_path, timeout_s=10, gpus=gpus)
    h.tick(8, output="step 1\n")
    h.tick(8, progress=(1.0, 10.0))
    h.tick(8, progress=(1.0, 10.0))   # the same progress again is no work...
    gpus.util_pct = 35.0
    h.tick(8)                          # ...but a busy GPU is
    gpus.util_pct = 0.0
    h.tick(8)
    assert h.flags == []
    h.tick(8)
    assert len(h.flags) == 1
    assert gpus.asked == [True, True, False, False, False, False]   # what simulated GPUs follow


def test_a_flagged_job_that_moves_again_is_cleared(tmp_path: Path) -> None:
    h = Harness(tmp_path, timeout_s=10)
    h.tick(11)
    h.tick(1, output="back\n")
    assert h.flags[-1] is None and len(h.flags) == 2
    h.tick(11)
    assert len(h.flags) == 3 and h.flags[-1] is not None    # idle again


def test_on_idle_kill_stops_the_job_once_it_is_idle(tmp_path: Path) -> None:
    h = Harness(tmp_path, timeout_s=10, kill=True)
    assert h.tick(9) is Directive.CONTINUE
    assert h.tick(1) is Directive.IDLE
    assert len(h.flags) == 1        # flagged before it is stopped


def test_without_an_idle_timeout_nothing_is_flagged_but_gpu_use_is_added_up(
        tmp_path: Path) -> None:
    gpus = Gpus(util_pct=0.0, used_gb=11.0)
    h = Harness(tmp_path, timeout_s=None, kill=True, gpus=gpus)
    assert h.tick(10_000) is Directive.CONTINUE
    gpus.util_pct, gpus.used_gb = 90.0, 30.0
    h.tick(1)
    gpus.util_pct, gpus.used_gb = 30.0, 12.0
    h.tick(1)
    facts = h.dog.use.facts()
    assert h.flags == []
    assert (facts.gpu_mem_peak_gb, facts.gpu_util_mean) == (30.0, 40.0)


def test_a_log_past_its_cap_counts_as_work_the_watchdog_cannot_see(tmp_path: Path) -> None:
    # Given an attempt whose log may grow by 10 bytes only, and that reached it
    h = Harness(tmp_path, timeout_s=10, kill=True, room=10)
    h.tick(1, output="0123456789")

    # Then it is never stopped for output it may still be writing
    assert h.tick(60) is Directive.CONTINUE and h.flags == []


def test_a_flag_the_store_refused_is_written_at_the_next_beat(tmp_path: Path) -> None:
    h = Harness(tmp_path, timeout_s=10)
    h.store_up = False
    h.tick(11)
    h.store_up = True
    h.tick(1)
    assert len(h.flags) == 1 and h.flags[0] is not None


def test_simulated_gpus_under_a_still_job_read_idle_and_under_a_working_one_busy(
        tmp_path: Path) -> None:
    # Given simulated GPUs: their utilisation follows the job's own signs of work
    monitor = GpuMonitor(SimulatedSource({0: 24.0}), max_age_s=1.0)
    h = Harness(tmp_path, timeout_s=10, kill=True, gpus=monitor)

    # When the job prints, then falls silent
    h.tick(5, output="x\n")
    assert h.tick(9) is Directive.CONTINUE
    assert h.tick(2) is Directive.IDLE

    # Then it held half of the GPU throughout, busy a third of the time
    facts = h.dog.use.facts()
    assert facts.gpu_mem_peak_gb == 12.0
    assert facts.gpu_util_mean == pytest.approx(20.0)


def test_no_reading_means_no_gpu_use_is_known() -> None:
    facts = GpuUse().facts()
    assert facts.gpu_mem_peak_gb is None and facts.gpu_util_mean is None
