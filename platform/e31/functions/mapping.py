"""The results of a `.map`: one array followed as a whole, each item's value fetched as it
ends, yielded in input order (the default) or as they complete.

The array is polled for its counts; only when more items have ended is the item list read,
and the ended items' values are fetched a few at a time (`FETCH_THREADS`). A failed item is
its exception, re-raised where the loop reaches it (with a note naming the item and how to
run the failed items again) or yielded with `return_exceptions=True`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, Literal

from e31.core.states import FINAL_STATES

if TYPE_CHECKING:
    from rich.progress import Progress

    from e31.client.handles import ArrayHandle, JobHandle

Order = Literal["input", "completed"]
POLL_S = 0.3          # the array's counts, while items run
ITEMS_EVERY_S = 1.0   # the item list (one row per item) at most this often, but at the end:
                      # a 10,000-item list read every poll would load the API for nothing
FETCH_THREADS = 8     # values fetched at once: enough to keep up with a pool finishing items


class _Failed:
    """An item's exception, kept until the loop reaches the item."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def results(array: ArrayHandle, *, order: Order = "input", return_exceptions: bool = False,
            progress: bool | None = None, timeout_s: float | None = None) -> Iterator[Any]:
    """The items' values (see the module); `JobTimeout` from the array after `timeout_s`."""
    total = len(array.job_ids)
    pending = set(range(total))
    ready: dict[int, Any] = {}
    next_index = 0
    seen_done, listed_at = -1, 0.0
    handles = array.jobs()
    with _bar(progress, total, array.id) as bar, ThreadPoolExecutor(FETCH_THREADS) as pool:
        for counts in array.watch(timeout_s, poll_s=POLL_S):
            due = time.monotonic() - listed_at >= ITEMS_EVERY_S or counts["done"] >= total
            if counts["done"] > seen_done and due:
                seen_done, listed_at = counts["done"], time.monotonic()
                ended = [i for i in array.status()["items"]
                         if i["index"] in pending and i["state"] in FINAL_STATES]
                for index, outcome in pool.map(
                        lambda i: (i["index"], _outcome(handles[i["index"]], i)), ended):
                    pending.discard(index)
                    ready[index] = outcome
            if bar is not None:
                bar.update(bar.task_ids[0], completed=total - len(pending))
            if order == "input":
                while next_index in ready:
                    yield _deliver(array, next_index, ready.pop(next_index), return_exceptions)
                    next_index += 1
            else:
                for index in sorted(ready):
                    yield _deliver(array, index, ready.pop(index), return_exceptions)
            if not pending:
                break


def _outcome(handle: JobHandle, item: dict[str, Any]) -> Any:
    status = {"id": item["id"], "state": item["state"]}
    try:
        if item["state"] != "succeeded":
            status = handle.status()
        return handle.value(status)
    except Exception as exc:  # noqa: BLE001 - the item's own exception, whatever it is
        return _Failed(exc)


def _deliver(array: ArrayHandle, index: int, outcome: Any, return_exceptions: bool) -> Any:
    if not isinstance(outcome, _Failed):
        return outcome
    exc = outcome.exc
    exc.add_note(f"item {index} of array {array.id} ({array.job_ids[index]}); "
                 f"`e31 retry {array.id} --failed` runs the failed items again")
    if return_exceptions:
        return exc
    raise exc


def _bar(progress: bool | None, total: int, label: str) -> AbstractContextManager[Progress | None]:
    """A bar of items done on stderr (a terminal) or in the notebook; none elsewhere."""
    if progress is None:
        progress = sys.stderr.isatty() or "ipykernel" in sys.modules
    if not progress:
        return nullcontext()
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    bar = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=Console(stderr=True))
    bar.add_task(label, total=total)
    return bar
