"""The workloads' shared parts without a model: the loader thread, the batch-size search and
the resumable output segments."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from e31_worker.workloads.pipeline import prefetch, search_batch_size
from e31_worker.workloads.segments import SegmentWriter


def test_prefetch_yields_every_item_in_order_from_another_thread() -> None:
    # Given a source that records the thread it runs on
    threads: set[str] = set()

    def source() -> Iterator[int]:
        for i in range(50):
            threads.add(threading.current_thread().name)
            yield i

    # When it is consumed through prefetch
    items = list(prefetch(source(), depth=2))

    # Then nothing is lost or reordered, and the loading ran off the consumer's thread
    assert items == list(range(50))
    assert threading.current_thread().name not in threads


def test_an_error_in_the_loader_reaches_the_consumer_after_the_items_before_it() -> None:
    # Given a source that fails after two items
    def source() -> Iterator[int]:
        yield 1
        yield 2
        raise ValueError("bad input")

    # When it is consumed
    seen: list[int] = []
    with pytest.raises(ValueError, match="bad input"):
        seen.extend(prefetch(source()))

    # Then the items before the failure arrived first
    assert seen == [1, 2]


def test_the_batch_size_search_doubles_to_the_largest_size_that_fits() -> None:
    # Given a device where batches up to 700 fit
    tried: list[int] = []

    def fits(n: int) -> bool:
        tried.append(n)
        return n <= 700

    # When the search starts at 32 with a limit of 4096
    size = search_batch_size(fits, start=32, limit=4096)

    # Then it doubled until the first failure and backed off to the last success
    assert size == 512
    assert tried == [32, 64, 128, 256, 512, 1024]


def test_the_batch_size_search_halves_when_the_start_does_not_fit_and_stops_at_the_limit() -> None:
    # Given a device where only 8 fits, and one where everything fits
    # When the search runs on each
    small = search_batch_size(lambda n: n <= 8, start=64, limit=4096)
    capped = search_batch_size(lambda n: True, start=64, limit=300)

    # Then the first halves down to 8 and the second stops below the limit
    assert small == 8
    assert capped == 256


def _writer(root: Path, every: int) -> SegmentWriter:
    return SegmentWriter(checkpoint_dir=root / "ckpt", scratch_dir=root / "scratch",
                         every_records=every, every_s=3600)


def test_segments_resume_after_the_last_commit_and_join_without_duplicates(tmp_path: Path) -> None:
    # Given an attempt that wrote 5 records with a commit every 2, then died
    first = _writer(tmp_path, every=2)
    assert first.resume() == 0
    for i in range(5):
        first.write("results", f"r{i}\n")
        first.advance(1)
    first.close()

    # When the next attempt resumes and writes the rest
    second = _writer(tmp_path, every=2)
    start = second.resume()
    for i in range(start, 7):
        kind = "errors" if i == 6 else "results"
        second.write(kind, f"{kind[0]}{i}\n")
        second.advance(1)
    (tmp_path / "out").mkdir()
    counts = second.finish(tmp_path / "out")

    # Then it started after record 4 (the uncommitted 5th was redone) and every row is there once
    assert start == 4
    assert (tmp_path / "out" / "results.jsonl").read_text().split() == [f"r{i}" for i in range(6)]
    assert (tmp_path / "out" / "errors.jsonl").read_text().split() == ["e6"]
    assert counts == {"results": 6, "errors": 1}


def test_a_segment_without_its_errors_file_is_not_counted_as_done(tmp_path: Path) -> None:
    # Given two committed segments, the second missing its errors file
    writer = _writer(tmp_path, every=1)
    writer.resume()
    for i in range(2):
        writer.write("results", f"r{i}\n")
        writer.advance(1)
    [second] = sorted((tmp_path / "ckpt").glob("000000000001-*.errors.jsonl"))
    second.unlink()

    # When a new attempt resumes
    # Then only the first segment counts
    assert _writer(tmp_path, every=1).resume() == 1
