"""The long poll of a job's end: `GET /v1/jobs/{id}?wait_s=N` holds its answer until the job is
final or N seconds pass, so `JobHandle.wait()` asks once where it would poll many times.

A worker publishes the job's id on `keys.JOB_ENDED` when it records a final outcome
(e31_worker.attempt.record); one
subscriber thread per API process (started by the first long poll) wakes the requests
waiting for that job at once. Every other way a job ends (a cancel, an expired lease, a
failed dependency, a message Redis lost) is seen by the store read each waiter makes every
`RECHECK_S`, so a lost notification costs latency, never a wrong answer. The waits are
asyncio waits: a thousand waiting clients hold no thread of the API's pool.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import defaultdict
from collections.abc import Awaitable, Callable

import redis

from e31.core import keys

log = logging.getLogger(__name__)

# The longest wait one request may ask for: below the 10 s that HTTP tools commonly give a
# request by default (schemathesis's, for one), so a held answer never looks like a hung API.
WAIT_MAX_S = 8
RECHECK_S = 2.0        # a waiter reads the job's state from the store at least this often
LISTEN_TIMEOUT_S = 1.0   # one read of the subscription; then a stop or a reconnect is seen


class JobEnds:
    """Wakes the long polls of a job when a worker says it ended (`publish_end`)."""

    def __init__(self, redis_client: redis.Redis) -> None:
        self._redis = redis_client
        self._lock = threading.Lock()
        self._waiters: dict[str, set[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = \
            defaultdict(set)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    async def wait_until_final(self, job_id: str, is_final: Callable[[], Awaitable[bool]],
                               timeout_s: float) -> None:
        """Return when the job's end is announced, when `is_final()` (a store read) says it
        ended, or after `timeout_s`. The waiter is registered before the first read, so an
        end announced meanwhile is not missed; an announcement is not read back (a worker
        announces an end only once its transaction committed: the answer's own read sees
        it); without one the store is read again every RECHECK_S."""
        loop = asyncio.get_running_loop()
        entry = (loop, asyncio.Event())
        deadline = loop.time() + timeout_s
        with self._lock:
            self._waiters[job_id].add(entry)
        try:
            self._start()   # after the registration: once it listens, this waiter hears
            while not await is_final():
                left = deadline - loop.time()
                if left <= 0:
                    return
                try:
                    await asyncio.wait_for(entry[1].wait(), min(left, RECHECK_S))
                except TimeoutError:
                    continue
                return   # announced: a worker announces an end once it is stored
        finally:
            with self._lock:
                waiting = self._waiters.get(job_id)
                if waiting is not None:
                    waiting.discard(entry)
                    if not waiting:
                        del self._waiters[job_id]

    def close(self) -> None:
        self._stop.set()

    def _start(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._listen, name="job-ends",
                                                daemon=True)
                self._thread.start()

    def _notify(self, job_id: str) -> None:
        with self._lock:
            waiting = list(self._waiters.get(job_id, ()))
        for loop, event in waiting:
            loop.call_soon_threadsafe(event.set)

    def _listen(self) -> None:
        while not self._stop.is_set():
            try:
                pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(keys.JOB_ENDED)
                try:
                    while not self._stop.is_set():
                        msg = pubsub.get_message(timeout=LISTEN_TIMEOUT_S)
                        if msg and msg.get("type") == "message":
                            data = msg["data"]
                            self._notify(data.decode() if isinstance(data, bytes) else str(data))
                finally:
                    pubsub.close()
            except Exception as exc:  # noqa: BLE001 - Redis gone or closed: the store reads
                log.warning("job_ends_unsubscribed: %s: %s; subscribing again",  # end the waits
                            type(exc).__name__, exc)
                self._stop.wait(LISTEN_TIMEOUT_S)

