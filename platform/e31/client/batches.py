"""`Client().batches`: batches of requests to language models, for users who never used
OpenAI's client (the same `/v1/files` and `/v1/batches` it calls; docs/workloads.md).

`Batches.submit` takes a JSONL file (or rows) of OpenAI batch requests, or of bare bodies
(`{"messages": [...]}`, `{"prompt": "..."}`, `{"input": "..."}`, each with an optional
`custom_id`), fills in `model`, `url` and `method` where a line lacks them (`to_requests`),
uploads it and creates the batch; the `BatchHandle` it returns waits, reads the results and
downloads the files.
"""

from __future__ import annotations

import builtins
import io
import json
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from e31.core.batches import ENDPOINTS, FINAL
from e31.core.errors import ClientError

if TYPE_CHECKING:
    from e31.client.client import Client

POLL_S = 1.0                   # how often `wait` reads the batch
# The endpoint a bare body is for, by the field that holds its input.
ENDPOINT_OF = {"messages": "/v1/chat/completions", "prompt": "/v1/completions",
               "input": "/v1/embeddings"}


def to_requests(rows: Iterable[Mapping[str, Any]], *, model: str | None,
                endpoint: str | None) -> tuple[list[dict[str, Any]], str]:
    """Rows as OpenAI batch request lines, and the batch's endpoint (given, or the one the
    first row's input field implies). `ClientError` naming the row for one that is neither a
    request nor a body."""
    out: list[dict[str, Any]] = []
    for n, row in enumerate(rows, start=1):
        if "body" in row:
            request = {"method": "POST", **row, "body": dict(row["body"])}
        else:
            body = {k: v for k, v in row.items() if k != "custom_id"}
            request = {"custom_id": row.get("custom_id"), "method": "POST", "body": body}
        if endpoint is None:
            endpoint = request.get("url") or next(
                (ENDPOINT_OF[k] for k in ENDPOINT_OF if k in request["body"]), None)
            if endpoint is None:
                raise ClientError(f"row {n}: no messages, prompt or input, and no url: say "
                                  "which endpoint (--endpoint)")
        request.setdefault("url", endpoint)
        request["custom_id"] = request.get("custom_id") or f"row-{n}"
        if model and not request["body"].get("model"):
            request["body"]["model"] = model
        out.append(request)
    if endpoint not in ENDPOINTS:
        raise ClientError(f"endpoint {endpoint!r}: one of {', '.join(ENDPOINTS)}")
    return out, endpoint


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file (`ClientError` naming a line that is not one)."""
    rows = []
    with path.open("rb") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise ClientError(f"{path}:{n}: not JSON: {exc}") from exc
            if not isinstance(row, dict):
                raise ClientError(f"{path}:{n}: not a JSON object")
            rows.append(row)
    return rows


class BatchHandle:
    """One batch: what the API last said of it (`info`, OpenAI's batch object)."""

    def __init__(self, client: Client, info: dict[str, Any]) -> None:
        self._client = client
        self.info = info

    @property
    def id(self) -> str:
        return str(self.info["id"])

    @property
    def status(self) -> str:
        return str(self.info["status"])

    def refresh(self) -> BatchHandle:
        self.info = self._client.request("GET", f"/v1/batches/{self.id}").json()
        return self

    def cancel(self) -> BatchHandle:
        self.info = self._client.request("POST", f"/v1/batches/{self.id}/cancel").json()
        return self

    def wait(self, timeout_s: float | None = None,
             on_progress: Callable[[dict[str, Any]], None] | None = None) -> BatchHandle:
        """Poll until the batch ends (any final status); `TimeoutError` past `timeout_s`."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.refresh().status not in FINAL:
            if on_progress is not None:
                on_progress(self.info)
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"batch {self.id} is still {self.status} after {timeout_s} s")
            time.sleep(POLL_S)
        return self

    def lines(self, which: str = "output") -> Iterator[dict[str, Any]]:
        """The rows of the output file (`which="output"`) or the error file (`"error"`)."""
        file_id = self.info.get(f"{which}_file_id")
        if not file_id:
            return
        with self._client.stream("GET", f"/v1/files/{file_id}/content") as response:
            for line in response.iter_lines():
                if line.strip():
                    yield json.loads(line)

    def results(self) -> dict[str, dict[str, Any]]:
        """Every request's row, output and error files together, by custom_id."""
        return {row["custom_id"]: row for which in ("output", "error")
                for row in self.lines(which)}

    def download(self, directory: Path) -> list[Path]:
        """Write the output and error files into `directory` (`<batch>_output.jsonl`,
        `<batch>_errors.jsonl`); returns the paths written."""
        directory.mkdir(parents=True, exist_ok=True)
        written = []
        for which, suffix in (("output", "output"), ("error", "errors")):
            file_id = self.info.get(f"{which}_file_id")
            if not file_id:
                continue
            path = directory / f"{self.id}_{suffix}.jsonl"
            with self._client.stream("GET", f"/v1/files/{file_id}/content") as response, \
                    path.open("wb") as f:
                for chunk in response.iter_bytes():
                    f.write(chunk)
            written.append(path)
        return written


class Batches:
    """`Client().batches`: submit, read, list and cancel batches; the pool's models."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def submit(self, requests: Path | str | Iterable[Mapping[str, Any]], *,
               model: str | None = None, endpoint: str | None = None,
               completion_window: str = "24h",
               metadata: Mapping[str, str] | None = None) -> BatchHandle:
        """Upload `requests` (a JSONL file's path, or rows) and create a batch of them."""
        rows = read_rows(Path(requests)) if isinstance(requests, str | Path) else list(requests)
        lines, endpoint = to_requests(rows, model=model, endpoint=endpoint)
        data = "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines).encode()
        uploaded = self._client.request(
            "POST", "/v1/files", data={"purpose": "batch"},
            files={"file": ("requests.jsonl", io.BytesIO(data), "application/jsonl")}).json()
        body: dict[str, Any] = {"input_file_id": uploaded["id"], "endpoint": endpoint,
                                "completion_window": completion_window}
        if metadata:
            body["metadata"] = dict(metadata)
        return BatchHandle(self._client, self._client.request("POST", "/v1/batches",
                                                              json=body).json())

    def get(self, batch_id: str) -> BatchHandle:
        return BatchHandle(self._client, {"id": batch_id, "status": "validating"}).refresh()

    def list(self, limit: int = 20) -> list[dict[str, Any]]:
        return list(self._client.request("GET", "/v1/batches",
                                         params={"limit": limit}).json()["data"])

    def cancel(self, batch_id: str) -> BatchHandle:
        return self.get(batch_id).cancel()

    def models(self) -> builtins.list[dict[str, Any]]:
        """The models a request's `body.model` may name."""
        return list(self._client.request("GET", "/v1/models").json()["data"])

    def add_model(self, name: str, path: str, *, kind: str | None = None,
                  gpu_mem_gb: float | None = None, replace: bool = False) -> dict[str, Any]:
        """Register a model (an admin's token)."""
        body: dict[str, Any] = {"name": name, "path": path, "replace": replace}
        if kind:
            body["kind"] = kind
        if gpu_mem_gb is not None:
            body["gpu_mem_gb"] = gpu_mem_gb
        answer: dict[str, Any] = self._client.request("POST", "/v1/admin/models",
                                                      json=body).json()
        return answer

    def remove_model(self, name: str) -> None:
        self._client.request("DELETE", f"/v1/admin/models/{name}")

