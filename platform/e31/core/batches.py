"""Batches of requests to language models, as OpenAI's Batch API has them (control plane: no
torch): the statuses, the endpoints, the completion windows, the ids, and the shard size.

A batch is an adapter over native objects (STYLE.md, rule 13): its input file is split into
shards, each shard one job of the `llm` workload, all of them one array; the batch's status
and counts are read from that array's jobs (`e31.api.services.batchends`).
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
import re
import secrets

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
# The body field that holds a request's input, per endpoint: a line without it is refused.
INPUT_FIELD = {"/v1/chat/completions": "messages", "/v1/completions": "prompt",
               "/v1/embeddings": "input"}
MODEL_KINDS = ("chat", "embed")
# Which kind of model an endpoint needs: a chat model completes, an embedding model embeds.
ENDPOINT_KIND = {"/v1/chat/completions": "chat", "/v1/completions": "chat",
                 "/v1/embeddings": "embed"}
SHARD_MIN_REQUESTS = 100   # a shard smaller than this costs more to start than it saves
# What the API and the `llm` workload share: a model directory's marker (`{"kind",
# "context_tokens"}`, written last by a build), and where a shard commits its segments under
# its job's checkpoints (the API finalises a cancelled or expired batch from them).
MODEL_MARKER = "e31_model.json"
SHARD_CHECKPOINTS = "llm"
REQUEST_ID_HEX = 24        # hex digits of a row's id after `batch_req_`
_WINDOW = re.compile(r"^([1-9][0-9]{0,4})([mhd])$")
_UNIT_S = {"m": 60, "h": 3600, "d": 86400}


class BatchStatus(enum.StrEnum):
    """OpenAI's statuses of a batch, in the order a batch may pass them."""

    VALIDATING = "validating"
    FAILED = "failed"              # the input file did not pass validation: nothing ran
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"      # every shard ended: the output files are being written
    COMPLETED = "completed"
    EXPIRED = "expired"            # past its window: what finished, and the rest as errors
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


FINAL = frozenset({BatchStatus.FAILED, BatchStatus.COMPLETED, BatchStatus.EXPIRED,
                   BatchStatus.CANCELLED})
# The timestamp field of the batch object that each status sets when it is entered.
STAMPED = {BatchStatus.IN_PROGRESS: "in_progress_at", BatchStatus.FINALIZING: "finalizing_at",
           BatchStatus.COMPLETED: "completed_at", BatchStatus.FAILED: "failed_at",
           BatchStatus.EXPIRED: "expired_at", BatchStatus.CANCELLING: "cancelling_at",
           BatchStatus.CANCELLED: "cancelled_at"}


def window_s(window: str) -> int:
    """The seconds of a completion window such as `24h`, `90m` or `3d`; `ValueError` naming
    it otherwise."""
    m = _WINDOW.fullmatch(window)
    if not m:
        raise ValueError(f"completion window {window!r} is not a number and a unit m, h or d "
                         "(e.g. 24h)")
    return int(m[1]) * _UNIT_S[m[2]]


def request_id(batch_id: str, custom_id: object) -> str:
    """The id of a request's row (`batch_req_…`): the same for the same request of the same
    batch, whichever process writes it (the workload a result, the API a request that never
    ran), so a resumed or finalised batch repeats no id."""
    seed = json.dumps([batch_id, custom_id]).encode()
    return "batch_req_" + hashlib.sha256(seed).hexdigest()[:REQUEST_ID_HEX]


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


def shard_sizes(total: int, *, slots: int, max_requests: int) -> list[int]:
    """How `total` requests of one model are split into shards: as many shards as the pool
    has GPUs for the model (`slots`), each of `SHARD_MIN_REQUESTS` at least and
    `max_requests` at most, as even as the count allows (the last ones one smaller)."""
    if total <= 0:
        return []
    per = math.ceil(total / max(1, slots))
    per = max(min(per, max_requests), min(SHARD_MIN_REQUESTS, max_requests))
    count = math.ceil(total / per)
    base, extra = divmod(total, count)
    return [base + 1 if i < extra else base for i in range(count)]
