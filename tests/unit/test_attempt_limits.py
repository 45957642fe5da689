"""The limits an attempt is given (e31_worker.attempt.attemptlimits): which setting or spec field
each comes from, the host's share of memory, what the disk watch counts, how status shows
them."""

from __future__ import annotations

from pathlib import Path

import pytest

from e31.cli.jobs import _limits
from e31.core.spec import JobSpec
from e31.edge.settings import Settings
from e31_worker.attempt.attemptlimits import (
    AttemptLimits,
    DiskWatch,
    attempt_limits,
    default_mem_gb,
    discard_writes,
)

MiB = 1 << 20


def spec(**resources: object) -> JobSpec:
    return JobSpec.parse({"command": ["true"], "resources": {"gpus": 0, **resources}})


def test_a_job_asking_nothing_gets_the_pools_pids_default_memory_and_disk() -> None:
    settings = Settings(attempt_pids_max=512, attempt_disk_gb=20)
    assert attempt_limits(settings, spec(), default_mem=6.0) == AttemptLimits(
        pids_max=512, mem_gb=6.0, disk_gb=20)


def test_what_a_job_asks_wins_and_its_disk_never_passes_the_pools_maximum() -> None:
    settings = Settings(attempt_disk_gb=20, attempt_disk_max_gb=100)
    assert attempt_limits(settings, spec(mem_gb=3, disk_gb=80), default_mem=6.0) == \
        AttemptLimits(pids_max=settings.attempt_pids_max, mem_gb=3, disk_gb=80)
    # asked before an operator lowered the maximum: it gets the maximum
    assert attempt_limits(Settings(attempt_disk_max_gb=50), spec(disk_gb=80),
                          default_mem=None).disk_gb == 50


def test_the_default_memory_is_the_setting_else_the_hosts_memory_shared_by_its_slots(
        tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       33554432 kB\nMemFree:        1 kB\n")   # 32 GiB
    assert default_mem_gb(Settings(), 4, meminfo) == 8.0
    assert default_mem_gb(Settings(), 0, meminfo) == 32.0      # a lone worker: the whole host
    assert default_mem_gb(Settings(default_mem_gb=3.5), 4, meminfo) == 3.5
    assert default_mem_gb(Settings(), 4, tmp_path / "missing") is None


def test_the_disk_watch_counts_what_the_job_wrote_and_only_what_it_added_to_its_inputs(
        tmp_path: Path) -> None:
    # Given an attempt whose inputs hold 4 MiB the pool staged, and an empty output tree
    inputs, output = tmp_path / "inputs", tmp_path / "output"
    inputs.mkdir()
    output.mkdir()
    (inputs / "staged.bin").write_bytes(b"x" * 4 * MiB)
    now = [0.0]
    watch = DiskWatch(trees=[output], staged=[inputs], max_bytes=3 * MiB, interval_s=5,
                      clock=lambda: now[0])

    # Then the staged inputs count nothing
    assert not watch.over() and watch.used_bytes < MiB
    # When the job writes 2 MiB of output and 2 MiB into its inputs
    (output / "a.bin").write_bytes(b"y" * 2 * MiB)
    (inputs / "added.bin").write_bytes(b"z" * 2 * MiB)
    # Then nothing is measured before the interval, and then both count
    assert not watch.over()
    now[0] = 10.0
    assert watch.over() and watch.used_bytes >= 4 * MiB


def test_discarding_an_attempts_writes_empties_its_trees_even_read_only_ones(
        tmp_path: Path) -> None:
    out = tmp_path / "output"
    (out / "deep").mkdir(parents=True)
    (out / "deep" / "f").write_text("data")
    (out / "deep").chmod(0o500)
    (out / "link").symlink_to(tmp_path / "outside")
    (tmp_path / "outside").write_text("keep")
    discard_writes([out])
    assert list(out.iterdir()) == []
    assert (tmp_path / "outside").read_text() == "keep"


def test_status_shows_the_limits_and_says_none_where_one_was_not_applied() -> None:
    assert _limits({"limits": {"pids_max": 4096, "mem_gb": 11.75, "disk_gb": 50.0}}) == \
        "pids 4096, mem 11.75 GB, disk 50 GB"
    assert _limits({"limits": {"pids_max": None, "mem_gb": None, "disk_gb": 0.05,
                               "network": "isolated"}}) == \
        "pids none, mem none, disk 0.05 GB, net isolated"
    assert _limits({"limits": None}) == "-"


def test_an_attempt_holding_more_files_than_a_walk_counts_is_over_its_limit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a walk that counts at most 50 entries, and a job that made 60 empty files
    import e31_worker.attempt.attemptlimits as limits
    monkeypatch.setattr(limits, "DISK_WALK_MAX_ENTRIES", 50)
    for i in range(60):
        (tmp_path / f"f{i}").touch()
    watch = DiskWatch(trees=[tmp_path], staged=[], max_bytes=1 << 30)

    # Then it is over its limit though it holds no bytes: the walk stayed bounded
    assert watch.over() and watch.entries == 50
