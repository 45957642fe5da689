"""What every workload shares: loading on a background thread, and the batch-size search."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

PREFETCH_DEPTH = 4        # batches prepared ahead of the model: hides jitter, little memory
JOIN_TIMEOUT_S = 5.0      # how long a closing pipeline waits for its loader thread
_DONE = object()


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def prefetch(items: Iterable[T], depth: int = PREFETCH_DEPTH) -> Iterator[T]:
    """Iterate `items` on a background thread, `depth` ahead of the consumer.

    Reading, parsing, decoding and collating then overlap with the model (torch releases the
    GIL in its kernels). An exception in the loader is raised in the consumer; a consumer that
    stops early stops the loader.
    """
    buffer: queue.Queue[Any] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(value: Any) -> bool:
        while not stop.is_set():
            try:
                buffer.put(value, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def load() -> None:
        try:
            for item in items:
                if not put(item):
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            put(_Failure(exc))
            return
        put(_DONE)

    thread = threading.Thread(target=load, name="e31-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            value = buffer.get()
            if value is _DONE:
                return
            if isinstance(value, _Failure):
                raise value.exc
            yield value
    finally:
        stop.set()
        thread.join(timeout=JOIN_TIMEOUT_S)


def search_batch_size(fits: Callable[[int], bool], start: int, limit: int) -> int:
    """The largest batch size that `fits`, by doubling from `start` up to `limit`.

    `fits(n)` runs one batch of `n` and says whether it ran (False on out-of-memory). When
    `start` itself does not fit, halves down to 1 (and returns 1 even if that fails: the run
    then reports the real error).
    """
    size = max(1, start)
    if not fits(size):
        while size > 1:
            size //= 2
            if fits(size):
                return size
        return 1
    while size * 2 <= limit and fits(size * 2):
        size *= 2
    return size


def cuda_batch_fits(model: Callable[[Any], Any], sample: Any, device: str) -> Callable[[int], bool]:
    """A `fits(n)` for `search_batch_size`: one forward pass of `n` copies of `sample` on CUDA."""
    import torch

    on_device = sample.to(device)

    def fits(n: int) -> bool:
        batch = None
        try:  # the copies are made on the GPU: the search measures GPU memory, not host memory
            batch = on_device.unsqueeze(0).expand(n, *sample.shape).contiguous()
            with torch.inference_mode():
                model(batch)
            torch.cuda.synchronize()
            return True
        except torch.cuda.OutOfMemoryError:
            return False
        finally:
            del batch
            torch.cuda.empty_cache()

    return fits
