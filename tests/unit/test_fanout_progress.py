"""The bar of a footage fan-out's merge job: the array's frames, and the rate in frames a second."""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from typing import Any

from rich.console import Console

from e31.client.progress import follow, progress_unit


class Watched:
    """A job handle whose statuses are given: the merge job while its array's chunks run."""

    id = "j-merge"

    def __init__(self, statuses: list[dict[str, Any]]) -> None:
        self._statuses = statuses

    def watch(self, timeout: float | None = None) -> Iterator[dict[str, Any]]:
        for status in self._statuses:
            time.sleep(0.05)   # the bar's rate is frames over the time between polls
            yield status


def merge_status(state: str, done: int) -> dict[str, Any]:
    return {"id": "j-merge", "name": "yard", "state": state, "after": ["a-" + "0" * 20],
            "progress": {"done": done, "total": 240}}


def test_a_merge_jobs_bar_counts_the_arrays_frames_and_shows_frames_a_second() -> None:
    # Given a merge job whose array has done 0, 80, 160 and then all 240 frames
    statuses = [merge_status("queued", 0), merge_status("queued", 80),
                merge_status("queued", 160), merge_status("succeeded", 240)]
    out = io.StringIO()

    # When it is followed with a bar
    last = follow(Watched(statuses), console=Console(file=out, width=120, force_terminal=False))

    # Then the bar ends at 240 of 240 with a rate in frames a second
    assert last["state"] == "succeeded"
    assert "frames/s" in out.getvalue()


def test_a_plain_jobs_progress_has_no_unit_and_a_fan_outs_has_frames() -> None:
    assert progress_unit(merge_status("running", 1)) == "frames"
    assert progress_unit({"after": [], "progress": {"done": 1, "total": 2}}) == ""
    assert progress_unit({"after": ["j-x"], "progress": {"done": 1, "total": 2}}) == ""
