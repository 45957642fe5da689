"""`Client`: one tenant's connection to an E31 Batch API, and every HTTP call the client makes.

The handles it returns (`JobHandle`, `ArrayHandle`, in `e31.client.handles`) call back
through `Client.request` and `Client.stream`, so one place turns an error answer into a
`ClientError` and rides out a brief store outage.
"""

from __future__ import annotations

import builtins
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import httpx

from e31.client import bundle
from e31.client.batches import Batches
from e31.client.handles import ArrayHandle, JobHandle
from e31.client.profile import read_profile
from e31.core.errors import ClientError

DEFAULT_TIMEOUT_S = 30.0     # one HTTP call; waiting for a job polls, so no call lasts long
UNAVAILABLE_RETRY_S = 60.0   # a read retried this long while the API answers 503
RETRY_AFTER_MAX_S = 10.0     # the longest wait between two such tries


class Client:
    """Talks to one E31 Batch API as one tenant.

    `url` and `token` default to `E31_URL` / `E31_TOKEN`, else the profile `e31 up` wrote
    under `E31_HOME`. `bundle_max_bytes` is the most a packed `workdir` or local input may
    take (default `E31_BUNDLE_MAX_BYTES`, else 100 MiB); the API has its own limit too.
    """

    def __init__(self, url: str | None = None, token: str | None = None, *,
                 timeout_s: float = DEFAULT_TIMEOUT_S,
                 bundle_max_bytes: int | None = None) -> None:
        self.bundle_max_bytes = bundle_max_bytes
        # The bundles the last submission needed, each uploaded or found held already.
        self.last_bundles: builtins.list[bundle.Sent] = []
        profile = read_profile() if not (url and token) else {}
        self.url = (url or os.environ.get("E31_URL") or profile.get("url") or "").rstrip("/")
        token = token or os.environ.get("E31_TOKEN") or profile.get("token")
        if not self.url or not token:
            raise ClientError("no API address or token: pass url= and token=, set E31_URL and "
                              "E31_TOKEN, or start a local stack with `e31 up`")
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s,
                                  headers={"Authorization": f"Bearer {token}"})

    @property
    def batches(self) -> Batches:
        """Batches of requests to language models (`e31.client.batches`)."""
        return Batches(self)

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

    @contextmanager
    def stream(self, method: str, path: str) -> Iterator[httpx.Response]:
        """One API call whose answer is read in chunks (an output file); an error answer
        raises `ClientError` as in `request` (which alone retries a read that meets 503)."""
        with self._http.stream(method, path) as response:
            if response.status_code >= 400:
                response.read()
                raise _error(response)
            yield response

    def submit(self, spec: dict[str, Any] | None = None, /, **fields: Any) -> JobHandle:
        """Submit one job from a spec mapping and/or the spec's fields as keywords.
        `workdir=DIR` sends a directory as the job's code, and an input that is a local path
        is sent too: each packed and uploaded unless the API holds it (`last_bundles`)."""
        body = self._with_bundles({**(spec or {}), **fields})
        status = self.request("POST", "/v1/jobs", json=body).json()
        return JobHandle(self, status["id"], status)

    def dry_run(self, spec: dict[str, Any] | None = None, /, **fields: Any) -> dict[str, Any]:
        """What `submit` would store (the spec, its class and queue, its code bundle) after
        the API's checks, and the bundles it would upload (`uploads`); nothing is stored."""
        body = self._with_bundles({**(spec or {}), **fields}, send=False)
        answer: dict[str, Any] = self.request("POST", "/v1/jobs", params={"dry_run": "true"},
                                              json=body).json()
        answer["uploads"] = [vars(s) for s in self.last_bundles if not s.held]
        return answer

    def _with_bundles(self, body: dict[str, Any], *, send: bool = True) -> dict[str, Any]:
        prepared, self.last_bundles = bundle.prepare(self, body, max_bytes=self.bundle_max_bytes,
                                                     send=send)
        return prepared

    def get(self, job_id: str) -> JobHandle:
        return JobHandle(self, job_id, self.request("GET", f"/v1/jobs/{job_id}").json())

    def submit_many(self, items: Iterable[Mapping[str, Any]], /, name: str | None = None,
                    **common: Any) -> ArrayHandle:
        """Submit N jobs as one array in one request: each item a spec mapping, `common` spec
        fields laid under every item (the item wins; `params` and `env` merge key by key).
        All or nothing: one bad item refuses the array with a `ClientError` (422) naming it."""
        body: dict[str, Any] = {"items": [self._with_bundles(dict(item)) for item in items],
                                "defaults": self._with_bundles(common)}
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

    def usage_report(self, all_tenants: bool = False) -> dict[str, Any]:
        """`GET /v1/usage` whole: `usage` (per tenant and class) and `batches` (the newest
        batches' requests, tokens in and out and GPU-seconds)."""
        params = {"all_tenants": "true"} if all_tenants else {}
        answer: dict[str, Any] = self.request("GET", "/v1/usage", params=params).json()
        return answer

    def usage(self, all_tenants: bool = False) -> builtins.list[dict[str, Any]]:
        return list(self.usage_report(all_tenants)["usage"])

    def queue(self) -> dict[str, Any]:
        """Per size class: GPUs, busy, queued jobs and running slots (GPUs, or a CPU class's
        jobs) per tenant, share used against weight (`e31 queue --json` prints the same)."""
        return dict(self.request("GET", "/v1/queue").json())

    def environments(self, **resources: Any) -> dict[str, Any]:
        """The Python environments of the live workers that would run a job of `resources`
        (`gpus`, `gpu_mem_gb`, `size_class`): `GET /v1/pool/environments`."""
        params = {k: v for k, v in resources.items() if v is not None}
        return dict(self.request("GET", "/v1/pool/environments", params=params).json())

    def set_secret(self, name: str, value: str) -> dict[str, Any]:
        """Set the tenant's secret `name` (created or replaced); a job names it in `secrets`
        and sees it as the environment variable `name`. The answer holds its name and dates."""
        return dict(self.request("PUT", f"/v1/secrets/{name}", json={"value": value}).json())

    def list_secrets(self) -> builtins.list[dict[str, Any]]:
        """The tenant's secrets: names and dates, never values."""
        return list(self.request("GET", "/v1/secrets").json()["secrets"])

    def delete_secret(self, name: str) -> None:
        self.request("DELETE", f"/v1/secrets/{name}")


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
