"""`ArrayRecord.to_status` and `array_state`: the array status of the public contract."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from e31.core.records import ArrayItem, ArrayRecord, array_state

T0 = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)
CONTRACT_KEYS = {"id", "name", "state", "total", "done", "succeeded", "failed", "cancelled",
                 "running", "queued", "items"}


@pytest.mark.parametrize("counts, state", [
    ({"queued": 3}, "queued"),
    ({"queued": 2, "running": 1}, "running"),
    ({"queued": 2, "succeeded": 1}, "running"),
    ({"succeeded": 3}, "succeeded"),
    ({"succeeded": 2, "failed": 1}, "failed"),
    ({"succeeded": 1, "failed": 1, "cancelled": 1}, "failed"),
    ({"succeeded": 2, "cancelled": 1}, "cancelled"),
])
def test_the_state_of_the_whole_follows_its_items(counts: dict[str, int], state: str) -> None:
    assert array_state(counts) == state


def test_the_status_counts_every_state_and_done_is_every_ended_item() -> None:
    # Given an array of five items in every state
    items = [ArrayItem(i, f"j-{i}", s, r) for i, (s, r) in enumerate(
        [("succeeded", None), ("failed", "error"), ("cancelled", "cancelled"),
         ("running", None), ("queued", None)])]
    record = ArrayRecord(id="a-1", tenant="acme", name="sweep", size=5, submitted_at=T0,
                         counts={"succeeded": 1, "failed": 1, "cancelled": 1, "running": 1,
                                 "queued": 1}, items=items)

    # When its status is built
    status = record.to_status()

    # Then it has every contract key, the counts, and the items in order, as plain JSON
    assert CONTRACT_KEYS <= set(status)
    assert (status["total"], status["done"], status["state"]) == (5, 3, "running")
    assert status["items"][1] == {"index": 1, "id": "j-1", "state": "failed", "reason": "error"}
    assert json.loads(json.dumps(status))["submitted_at"] == "2025-03-01T12:00:00+00:00"


def test_a_status_without_items_has_the_counts_only() -> None:
    record = ArrayRecord(id="a-1", tenant="acme", name="sweep", size=2, submitted_at=T0,
                         counts={"queued": 2})
    status = record.to_status()
    assert "items" not in status
    assert (status["queued"], status["running"], status["done"]) == (2, 0, 0)
