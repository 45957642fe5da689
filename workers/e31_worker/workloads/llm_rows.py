"""The lines of `results.jsonl` and `errors.jsonl`, exactly as OpenAI's batch output.

    {"id": "batch_req_<24 hex>", "custom_id": ..., "response": {"status_code": 200,
     "request_id": "<32 hex>", "body": <a chat.completion, text_completion or list>},
     "error": null}

The ids derive from (batch id, custom id) through SHA-256, so that an attempt that redoes a
request writes the same ids; `created` is the time the row was made.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import struct
import time
from typing import Any

from e31.core.batches import request_id
from e31_worker.workloads.llm_requests import (
    CHAT,
    COMPLETIONS,
    Choice,
    Request,
    RequestError,
)

REQUEST_ID_HEX = 32


class Rows:
    """Formats the rows of one batch's requests for one model and endpoint."""

    def __init__(self, *, batch_id: str, model_name: str, endpoint: str) -> None:
        self._batch_id = batch_id
        self._model = model_name
        self._endpoint = endpoint

    def completion(self, request: Request, choices: list[list[Choice]]) -> str:
        """The result row of a chat or completions request: `choices[p]` are prompt p's n."""
        ids = self._ids(request.custom_id)
        flat = [c for per_prompt in choices for c in per_prompt]
        prompt_tokens = sum(len(p) for p in request.prompts)
        completion_tokens = sum(c.completion_tokens for c in flat)
        if self._endpoint == CHAT:
            body: dict[str, Any] = {
                "id": f"chatcmpl-{ids['body']}", "object": "chat.completion",
                "created": int(time.time()), "model": self._model,
                "choices": [{"index": i, "message": {"role": "assistant", "content": c.text},
                             "finish_reason": c.finish_reason, "logprobs": None}
                            for i, c in enumerate(flat)]}
        elif self._endpoint == COMPLETIONS:
            body = {"id": f"cmpl-{ids['body']}", "object": "text_completion",
                    "created": int(time.time()), "model": self._model,
                    "choices": [{"index": i, "text": c.text, "finish_reason": c.finish_reason,
                                 "logprobs": None} for i, c in enumerate(flat)]}
        else:
            raise ValueError(f"{self._endpoint} does not complete text")
        body["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                         "total_tokens": prompt_tokens + completion_tokens}
        return self._row(request.custom_id, ids, 200, body)

    def embedding(self, request: Request, vectors: list[list[float]]) -> str:
        """The result row of an embeddings request: one vector per input."""
        ids = self._ids(request.custom_id)
        data = [{"object": "embedding", "index": i,
                 "embedding": _encoded(v, request.encoding_format, request.dimensions)}
                for i, v in enumerate(vectors)]
        tokens = sum(len(p) for p in request.prompts)
        body = {"object": "list", "data": data, "model": self._model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
        return self._row(request.custom_id, ids, 200, body)

    def error(self, custom_id: Any, err: RequestError, *, status_code: int = 400,
              kind: str = "invalid_request_error") -> str:
        """The error row of a request that failed on its own."""
        body = {"error": {"message": str(err), "type": kind, "param": err.param,
                          "code": err.code}}
        return self._row(custom_id, self._ids(custom_id), status_code, body)

    def _ids(self, custom_id: Any) -> dict[str, str]:
        seed = json.dumps([self._batch_id, custom_id]).encode()
        return {"row": request_id(self._batch_id, custom_id),
                "request": hashlib.sha256(b"request:" + seed).hexdigest()[:REQUEST_ID_HEX],
                "body": hashlib.sha256(b"body:" + seed).hexdigest()[:REQUEST_ID_HEX]}

    @staticmethod
    def _row(custom_id: Any, ids: dict[str, str], status_code: int, body: Any) -> str:
        return json.dumps({"id": ids["row"], "custom_id": custom_id,
                           "response": {"status_code": status_code,
                                        "request_id": ids["request"], "body": body},
                           "error": None}) + "\n"


def usage_of(row: bytes) -> tuple[int, int]:
    """(prompt_tokens, completion_tokens) of a committed result row (0, 0 when it has none)."""
    usage = (json.loads(row).get("response") or {}).get("body", {}).get("usage") or {}
    return int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))


def _encoded(vector: list[float], encoding_format: str, dimensions: int | None) -> Any:
    """The vector as OpenAI sends it: floats, or base64 of little-endian float32; shortened
    to `dimensions` (and normalised again) when asked, as OpenAI's newer models do."""
    if dimensions is not None and dimensions < len(vector):
        vector = vector[:dimensions]
        norm = math.sqrt(sum(x * x for x in vector)) or 1.0
        vector = [x / norm for x in vector]
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector
