"""`Client`, `JobHandle` and `ArrayHandle`: the Python interface over the HTTP API."""

from __future__ import annotations

import builtins
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from e31.errors import ClientError, JobFailed, JobTimeout
from e31.client.profile import read_profile

POLL_S = 0.5                 # status poll while waiting
UNAVAILABLE_RETRY_S = 60.0   # a read retried this long while the API answers 503
RETRY_AFTER_MAX_S = 10.0     # the longest wait between two such tries
FINAL = {"succeeded", "failed", "cancelled"}


class Client:
    """Talks to one E31 Batch API as one tenant.

    `url` and `token` default to `E31_URL` / `E31_TOKEN`, else the profile `e31 up` wrote
    under `E31_HOME`.
    """

    def __init__(self, url: str | None = None, token: str | None = None, *,
                 timeout_s: float = 30.0) -> None:
        profile = read_profile() if not (url and token) else {}
        self.url = (url or os.environ.get("E31_URL") or profile.get("url") or "").rstrip("/")
        token = token or os.environ.get("E31_TOKEN") or profile.get("token")
        if not self.url or not token:
            raise ClientError("no API address or token: pass url= and token=, set E31_URL and "
                              "E31_TOKEN, or start a local stack with `e31 up`")
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s,
                                  headers={"Authorization": f"Bearer {token}"})

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One API call. A read (GET) that meets 503 — the results store is briefly
        unreachable — is retried after the server's Retry-After for up to
        `UNAVAILABLE_RETRY_S`, so `wait()` rides out a store outage."""
        deadline = time.monotonic() + UNAVAILABLE_RETRY_S
        while True:
            try:
                response = self._http.request(method, path, **kwargs)
            except httpx.HTTPError as exc:
                raise ClientError(f"cannot reach the E31 API at {self.url}: {exc}") from exc
            if response.status_code == 503 and method == "GET" and time.monotonic() < deadline:
                time.sleep(min(_retry_after_s(response), max(0.0, deadline - time.monotonic())))
                continue
            if response.status_code >= 400:
                raise _error(response)
            return response

    def submit(self, spec: dict[str, Any] | None = None, /, **fields: Any) -> JobHandle:
        """Submit one job from a spec mapping and/or the spec's fields as keywords."""
        body = {**(spec or {}), **fields}
        status = self.request("POST", "/v1/jobs", json=body).json()
        return JobHandle(self, status["id"], status)

    def get(self, job_id: str) -> JobHandle:
        return JobHandle(self, job_id, self.request("GET", f"/v1/jobs/{job_id}").json())

    def submit_many(self, items: Iterable[Mapping[str, Any]], /, name: str | None = None,
                    **common: Any) -> ArrayHandle:
        """Submit N jobs as one array in one request: each item a spec mapping, `common` spec
        fields laid under every item (the item wins; `params` and `env` merge key by key).
        All or nothing: one bad item refuses the array with a `ClientError` (422) naming it."""
        body: dict[str, Any] = {"items": [dict(item) for item in items], "defaults": common}
        if name is not None:
            body["name"] = name
        status = self.request("POST", "/v1/arrays", json=body).json()
        return ArrayHandle(self, status["id"], job_ids=status["jobs"])

    def get_array(self, array_id: str) -> ArrayHandle:
        status = self.request("GET", f"/v1/arrays/{array_id}").json()
        return ArrayHandle(self, array_id, job_ids=[i["id"] for i in status["items"]])

    def list(self, state: str | None = None, limit: int = 100) -> builtins.list[dict[str, Any]]:
        params: dict[str, Any] = {"limit": limit}
        if state:
            params["state"] = state
        return list(self.request("GET", "/v1/jobs", params=params).json()["jobs"])

    def usage(self, all_tenants: bool = False) -> builtins.list[dict[str, Any]]:
        params = {"all_tenants": "true"} if all_tenants else {}
        return list(self.request("GET", "/v1/usage", params=params).json()["usage"])

    def queue(self) -> dict[str, Any]:
        """Per size class: GPUs, busy, queued jobs and running GPUs per tenant, share used
        against weight (`e31 queue --json` prints the same)."""
        return dict(self.request("GET", "/v1/queue").json())


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

    def watch(self, timeout: float | None = None, poll_s: float = POLL_S) -> Iterator[dict[str, Any]]:
        """Yield the status at each poll until the job is final; `JobTimeout` after `timeout` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            status = self.status()
            yield status
            if status["state"] in FINAL:
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
            status = {}
            for status in self.watch(timeout):
                pass
        if status["state"] != "succeeded":
            raise JobFailed(status)
        return status

    def result(self) -> Any:
        """The job's JSON result; `JobFailed` if it ended otherwise, `ClientError` if still live."""
        status = self.status()
        if status["state"] == "succeeded":
            return status["result"]
        if status["state"] in FINAL:
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
            with self._client._http.stream("GET", url) as r:
                if r.status_code >= 400:
                    r.read()
                    raise _error(r)
                with open(target, "wb") as f:
                    f.writelines(r.iter_bytes())
            paths.append(target)
        return paths

    def logs(self, attempt: int | None = None, offset: int = 0) -> str:
        params: dict[str, Any] = {"offset": offset}
        if attempt is not None:
            params["attempt"] = attempt
        return self._client.request("GET", f"/v1/jobs/{self.id}/logs", params=params).text

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

    def watch(self, timeout: float | None = None, poll_s: float = POLL_S) -> Iterator[dict[str, Any]]:
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
            _follow_array(self, timeout)
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


def _follow_array(array: ArrayHandle, timeout: float | None) -> None:
    """A progress bar of the whole array on stderr: items done of the total."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[counts]}"), TimeElapsedColumn(),
                  console=Console(stderr=True)) as bar:
        task = bar.add_task(array.id, total=None, counts="")
        for st in array.watch(timeout):
            counts = ", ".join(f"{st[k]} {k}" for k in ("running", "succeeded", "failed",
                                                          "cancelled") if st.get(k))
            bar.update(task, total=st["total"], completed=st["done"], counts=counts,
                       description=f"{st.get('name') or array.id} ({array.id})")


def _error(response: httpx.Response) -> ClientError:
    try:
        body = response.json()
        message = body.get("message") or str(body)
    except ValueError:
        body, message = response.text, response.text or response.reason_phrase
    return ClientError(message, status_code=response.status_code, body=body)


def _retry_after_s(response: httpx.Response) -> float:
    try:
        return min(RETRY_AFTER_MAX_S, max(0.1, float(response.headers.get("Retry-After", "1"))))
    except ValueError:
        return 1.0
