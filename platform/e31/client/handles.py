"""`JobHandle` and `ArrayHandle`: what a user holds after a submit, and calls to follow,
fetch or cancel the work. Every call goes through the `Client` that made the handle."""

from __future__ import annotations

import builtins
import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from e31.core.errors import ClientError, FunctionError, JobFailed, JobTimeout, RemoteError
from e31.core.functioncalls import (
    EXCEPTION_FILE,
    RESULT_FILE,
    RESULT_MARK,
    TRACEBACK_FILE,
    is_function_result,
)
from e31.core.states import FINAL_STATES

if TYPE_CHECKING:
    from e31.client.client import Client

POLL_S = 0.5                 # status poll while waiting for an array
WAIT_POLL_FIRST_S = 0.05     # a job's status: first poll, then each wait 1.5 times the last,
WAIT_POLL_GROWTH = 1.5
WAIT_POLL_MAX_S = 1.0        # up to this: a tiny job is seen ended within ~50 ms, a long one
                             # costs one request a second
FOLLOW_POLL_S = 1.0          # status and log poll while following a log (`e31 logs -f`)
# GET …/logs: the log's size (e31.api.routes.jobs says the same)
LOG_SIZE_HEADER = "X-E31-Log-Size"
WAIT_LONG_POLL_S = 8         # wait(): one long poll (GET /v1/jobs/{id}?wait_s=…); the API's cap
LONG_POLL_SLACK_S = 30.0     # its HTTP timeout beyond the wait


class JobHandle:
    """A submitted job, as its owner holds it."""

    def __init__(self, client: Client, job_id: str, status: dict[str, Any] | None = None) -> None:
        self._client = client
        self.id = job_id
        self._last = status or {}

    def __repr__(self) -> str:
        return f"JobHandle({self.id!r}, state={self._last.get('state')!r})"

    def status(self, wait_s: int = 0) -> dict[str, Any]:
        """The job's status; with `wait_s`, the API holds the answer until the job is final or
        `wait_s` seconds passed (a long poll, at most 8 s)."""
        if not wait_s:
            self._last = self._client.request("GET", f"/v1/jobs/{self.id}").json()
        else:
            self._last = self._client.request(
                "GET", f"/v1/jobs/{self.id}", params={"wait_s": wait_s},
                timeout=wait_s + LONG_POLL_SLACK_S).json()
        return self._last

    def watch(self, timeout: float | None = None,
              poll_s: float | None = None) -> Iterator[dict[str, Any]]:
        """Yield the status at each poll until the job is final; `JobTimeout` after `timeout` s.
        Polls every `poll_s` seconds when given; by default the first poll follows 50 ms after
        the first status and each wait grows 1.5 times up to 1 s (`poll_delays`), so a short
        job is seen ended soon after it ends and a long one is asked about once a second."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delays = poll_delays() if poll_s is None else itertools.repeat(poll_s)
        while True:
            status = self.status()
            yield status
            if status["state"] in FINAL_STATES:
                return
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise JobTimeout(f"job {self.id} still {status['state']} after {timeout:g} s")
            delay = next(delays)
            time.sleep(delay if deadline is None else min(delay, deadline - now))

    def wait(self, timeout: float | None = None, progress: bool = False) -> dict[str, Any]:
        """Block until the job ends; return its status, or raise `JobFailed` unless it succeeded.
        With `progress`, a bar on stderr, and while the job is queued why it waits, at once and
        at each change (`e31.client.progress.follow`)."""
        if progress:
            from e31.client.progress import follow
            status = follow(self, timeout=timeout)
        else:
            status = self._until_final(timeout)
        if status["state"] != "succeeded":
            raise JobFailed(status)
        return status

    def _until_final(self, timeout: float | None) -> dict[str, Any]:
        """The final status, by long polls of up to WAIT_LONG_POLL_S each: one request for a
        job that ends within one, answered as soon as it ends. An API that answers a long poll
        at once (one from before it) is polled instead, every `poll_delays()`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delays = poll_delays()
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            ask = WAIT_LONG_POLL_S if left is None else max(0, min(WAIT_LONG_POLL_S, int(left)))
            asked_at = time.monotonic()
            status = self.status(wait_s=ask)
            if status["state"] in FINAL_STATES:
                return status
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise JobTimeout(f"job {self.id} still {status['state']} after {timeout:g} s")
            if ask == 0 or now - asked_at < ask / 2:   # not held: poll with back-off
                delay = next(delays)
                time.sleep(delay if deadline is None else min(delay, deadline - now))

    def result(self) -> Any:
        """The job's JSON result; `JobFailed` if it ended otherwise, `ClientError` if still live.
        A function job's (`@e31.function`) is its Python value (`value()`)."""
        status = self.status()
        if status["state"] == "succeeded":
            if is_function_result(status["result"]):
                return self.value(status)
            return status["result"]
        if status["state"] in FINAL_STATES:
            raise JobFailed(status)
        raise ClientError(f"job {self.id} is {status['state']}; no result yet (use wait())")

    def value(self, status: dict[str, Any] | None = None) -> Any:
        """A function job's Python value, from its output `result.pkl` (unpickled here, by its
        owner; the platform never does). A failed one raises the function's own exception with
        the remote traceback as a note, or `RemoteError` holding it when the exception could
        not travel; a result over the pool's output limit is a `FunctionError`."""
        import cloudpickle
        status = status or self.status()
        if status["state"] == "succeeded":
            data = self.output_bytes(RESULT_FILE)
            if data is None:
                size = ((status.get("result") or {}).get(RESULT_MARK) or {}).get("bytes")
                raise FunctionError(f"job {self.id} succeeded but its value ({size} bytes "
                                    "pickled) was not stored: larger than the pool's output "
                                    "limit (job_outputs_max_bytes); return less, or write big "
                                    "data to an output file")
            return cloudpickle.loads(data)
        if status["state"] not in FINAL_STATES:
            raise ClientError(f"job {self.id} is {status['state']}; no value yet (use wait())")
        text = (self.output_bytes(TRACEBACK_FILE) or b"").decode("utf-8", "replace")
        pickled = self.output_bytes(EXCEPTION_FILE)
        if pickled is not None:
            try:
                exc = cloudpickle.loads(pickled)
            except Exception:  # noqa: BLE001 - its class may not load here: say it as text
                exc = None
            if isinstance(exc, BaseException):
                exc.add_note(f"remote traceback (job {self.id}):\n{text.rstrip()}")
                raise exc
        raise RemoteError(status, text)

    def output_bytes(self, path: str) -> bytes | None:
        """One output file's bytes, or None when the job has no such output."""
        try:
            with self._client.stream("GET", f"/v1/jobs/{self.id}/outputs/{quote(path)}") as r:
                return r.read()
        except ClientError as exc:
            if exc.status_code == 404:
                return None
            raise

    def outputs(self) -> list[dict[str, Any]]:
        return list(self._client.request("GET", f"/v1/jobs/{self.id}/outputs").json()["outputs"])

    def download(self, directory: str | Path) -> list[Path]:
        """Fetch every output file into `directory`; returns the local paths."""
        root = Path(directory)
        paths = []
        for item in self.outputs():
            target = root / item["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            url = f"/v1/jobs/{self.id}/outputs/{quote(item['path'])}"
            with self._client.stream("GET", url) as r, open(target, "wb") as f:
                f.writelines(r.iter_bytes())
            paths.append(target)
        return paths

    def logs(self, attempt: int | None = None, offset: int = 0) -> str:
        """The job's log from byte `offset`: one attempt's, or (None) every attempt's, each
        under `=== attempt N ===`. Fetched chunk after chunk to its current end."""
        return b"".join(self.log_chunks(attempt, offset)).decode("utf-8", errors="replace")

    def log_chunks(self, attempt: int | None = None, offset: int = 0) -> Iterator[bytes]:
        """The log's bytes from `offset` to its end as it is now, one API answer at a time:
        the API answers at most a bounded chunk (`log_chunk_max_bytes`) per request and says
        the log's size, so this asks again from where the last chunk ended until there."""
        params: dict[str, Any] = {"offset": offset}
        if attempt is not None:
            params["attempt"] = attempt
        while True:
            response = self._client.request("GET", f"/v1/jobs/{self.id}/logs", params=params)
            chunk = response.content
            if chunk:
                yield chunk
            params["offset"] += len(chunk)
            size = int(response.headers.get(LOG_SIZE_HEADER, "0"))
            if not chunk or params["offset"] >= size:
                return

    def follow_logs(self, attempt: int | None = None, *,
                    poll_s: float = FOLLOW_POLL_S) -> Iterator[bytes]:
        """The log as it grows, until the job ends: one attempt's, or every attempt's in turn,
        each under its `=== attempt N ===` line as `logs()` has them. An attempt's log is read
        to its end once the attempt has ended (the worker stores the last of it before it
        records the end), and only then does the next attempt's header come."""
        offsets: dict[int, int] = {}     # bytes yielded so far, per attempt
        done: set[int] = set()           # attempts ended and read to their end
        while True:
            st = self.status()
            final = st["state"] in FINAL_STATES
            for a in st["attempts"]:
                n = a["n"]
                if n in done or attempt not in (None, n):
                    continue
                if n not in offsets:
                    offsets[n] = 0
                    if attempt is None:
                        yield f"=== attempt {n} ===\n".encode()
                for chunk in self.log_chunks(n, offsets[n]):
                    offsets[n] += len(chunk)
                    yield chunk
                if a["ended_at"] is None and not final:
                    break          # it still runs: no later attempt exists yet
                done.add(n)
            if final:
                return
            time.sleep(poll_s)

    def cancel(self) -> dict[str, Any]:
        self._last = self._client.request("POST", f"/v1/jobs/{self.id}/cancel").json()
        return self._last


def poll_delays(first_s: float = WAIT_POLL_FIRST_S, growth: float = WAIT_POLL_GROWTH,
                max_s: float = WAIT_POLL_MAX_S) -> Iterator[float]:
    """The waits between a job's status polls: `first_s`, then each `growth` times the last,
    never more than `max_s`."""
    delay = first_s
    while True:
        yield delay
        delay = min(delay * growth, max_s)


class ArrayHandle:
    """A submitted array (a sweep): its items are jobs, and it is followed as a whole."""

    def __init__(self, client: Client, array_id: str, *, job_ids: builtins.list[str]) -> None:
        self._client = client
        self.id = array_id
        self.job_ids = job_ids          # in item order: job_ids[i] is item i

    def __repr__(self) -> str:
        return f"ArrayHandle({self.id!r}, size={len(self.job_ids)})"

    def status(self, items: bool = True) -> dict[str, Any]:
        """id, name, state, total, done (ended either way), succeeded, failed, cancelled,
        running, queued, and `items` ([{index, id, state, reason}]) unless `items=False`."""
        params = {} if items else {"items": "false"}
        return dict(self._client.request("GET", f"/v1/arrays/{self.id}", params=params).json())

    def watch(self, timeout: float | None = None,
              poll_s: float = POLL_S) -> Iterator[dict[str, Any]]:
        """Yield the counts (no items) at each poll until every item is final; `JobTimeout`
        after `timeout` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            status = self.status(items=False)
            yield status
            if status["done"] >= status["total"]:
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise JobTimeout(f"array {self.id}: {status['done']} of {status['total']} items "
                                 f"done after {timeout:g} s")
            time.sleep(poll_s)

    def wait(self, timeout: float | None = None, progress: bool = False) -> dict[str, Any]:
        """Block until every item is final and return the status, with its items.

        Unlike `JobHandle.wait`, this does not raise when items failed: look at `failed`,
        `cancelled` or `state` (`succeeded` only when every item did), or at `manifest()`.
        """
        if progress:
            from e31.client.progress import follow_array
            follow_array(self, timeout=timeout)
        else:
            for _ in self.watch(timeout):
                pass
        return self.status()

    def cancel(self) -> dict[str, Any]:
        """Cancel every item: queued ones at once, running ones within seconds; ended ones stay."""
        return dict(self._client.request("POST", f"/v1/arrays/{self.id}/cancel").json())

    def retry_failed(self) -> dict[str, Any]:
        """Queue the failed and cancelled items again, as their next attempt (the same jobs, in
        the same slots), and the jobs their failure had cancelled, such as a merge job after
        the array; returns the array's status with `resubmitted` and `rearmed` ids."""
        return dict(self._client.request("POST", f"/v1/arrays/{self.id}/retry").json())

    def manifest(self) -> dict[str, Any]:
        """The status and, per item in index order: index, id, state, params, result, outputs,
        reason and error."""
        return dict(self._client.request("GET", f"/v1/arrays/{self.id}/manifest").json())

    def jobs(self) -> builtins.list[JobHandle]:
        """A `JobHandle` per item, in index order."""
        return [JobHandle(self._client, job_id) for job_id in self.job_ids]
