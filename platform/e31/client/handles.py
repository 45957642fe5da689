"""`JobHandle` and `ArrayHandle`: what a user holds after a submit, and calls to follow,
fetch or cancel the work. Every call goes through the `Client` that made the handle."""

from __future__ import annotations

import builtins
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from e31.errors import ClientError, JobFailed, JobTimeout
from e31.states import FINAL_STATES

if TYPE_CHECKING:
    from e31.client.client import Client

POLL_S = 0.5                 # status poll while waiting
LOG_SIZE_HEADER = "X-E31-Log-Size"   # GET …/logs: the log's size (e31.api.app says the same)


class JobHandle:
    """A submitted job, as its owner holds it."""

    def __init__(self, client: Client, job_id: str, status: dict[str, Any] | None = None) -> None:
        self._client = client
        self.id = job_id
        self._last = status or {}

    def __repr__(self) -> str:
        return f"JobHandle({self.id!r}, state={self._last.get('state')!r})"

    def status(self) -> dict[str, Any]:
        self._last = self._client.request("GET", f"/v1/jobs/{self.id}").json()
        return self._last

    def watch(self, timeout: float | None = None,
              poll_s: float = POLL_S) -> Iterator[dict[str, Any]]:
        """Yield the status at each poll until the job is final; `JobTimeout` after `timeout` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            status = self.status()
            yield status
            if status["state"] in FINAL_STATES:
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise JobTimeout(f"job {self.id} still {status['state']} after {timeout:g} s")
            time.sleep(poll_s)

    def wait(self, timeout: float | None = None, progress: bool = False) -> dict[str, Any]:
        """Block until the job ends; return its status, or raise `JobFailed` unless it succeeded."""
        if progress:
            from e31.client.progress import follow
            status = follow(self, timeout=timeout)
        else:
            status = deque(self.watch(timeout), maxlen=1)[0]   # the last one: the job ended
        if status["state"] != "succeeded":
            raise JobFailed(status)
        return status

    def result(self) -> Any:
        """The job's JSON result; `JobFailed` if it ended otherwise, `ClientError` if still live."""
        status = self.status()
        if status["state"] == "succeeded":
            return status["result"]
        if status["state"] in FINAL_STATES:
            raise JobFailed(status)
        raise ClientError(f"job {self.id} is {status['state']}; no result yet (use wait())")

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

    def cancel(self) -> dict[str, Any]:
        self._last = self._client.request("POST", f"/v1/jobs/{self.id}/cancel").json()
        return self._last


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

    def manifest(self) -> dict[str, Any]:
        """The status and, per item in index order: index, id, state, params, result, outputs,
        reason and error."""
        return dict(self._client.request("GET", f"/v1/arrays/{self.id}/manifest").json())

    def jobs(self) -> builtins.list[JobHandle]:
        """A `JobHandle` per item, in index order."""
        return [JobHandle(self._client, job_id) for job_id in self.job_ids]
