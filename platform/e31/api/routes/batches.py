"""`/v1/batches` and `/v1/models`: OpenAI's Batch API over the pool (`e31.api.services.batches`),
and the models a batch's requests may name (`e31.api.services.models`; `/v1/admin/models` for
admins). The batch object is OpenAI's, with `e31` added: the array of its shards, its shards'
models and request counts, and its GPU-seconds.
"""

# No `from __future__ import annotations`: the routes' annotations name a model made inside
# `router` (it carries the pool's windows), which FastAPI must see as an object.
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from e31.api import errors
from e31.api.auth import Caller, actor
from e31.api.requestlimits import DIGITS
from e31.api.routes.fields import Name
from e31.api.routes.files import listing
from e31.api.services.batches import BatchService
from e31.api.services.models import ModelService
from e31.core.batches import ENDPOINTS, STAMPED
from e31.edge.settings import Settings
from e31.store.batches import LIST_MAX
from e31.store.models import Batch

BATCHES_PATH = "/v1/batches"
Endpoint = Literal[ENDPOINTS]  # type: ignore[valid-type]


class NewModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: Name
    path: str = Field(min_length=2, max_length=4096, pattern=r"^(/|file:///|s3://)[^\x00]+$",
                      description="a directory beneath models_dir or input_file_roots, or s3://")
    kind: Literal["chat", "embed"] | None = None
    gpu_mem_gb: float | None = Field(default=None, gt=0, le=100_000)
    replace: bool = False


def batch_object(b: Batch) -> dict[str, Any]:
    """The batch as OpenAI shows it."""
    def stamp(name: str) -> int | None:
        value = getattr(b, name)
        return int(value.timestamp()) if value is not None else None

    return {
        "id": b.id, "object": "batch", "endpoint": b.endpoint, "errors": b.errors,
        "input_file_id": b.input_file_id, "completion_window": b.completion_window,
        "status": b.status, "output_file_id": b.output_file_id,
        "error_file_id": b.error_file_id, "created_at": stamp("created_at"),
        "expires_at": stamp("expires_at"), **{f: stamp(f) for f in STAMPED.values()},
        "request_counts": {"total": b.request_total, "completed": b.request_completed,
                           "failed": b.request_failed},
        "usage": {"input_tokens": b.prompt_tokens, "output_tokens": b.completion_tokens,
                  "total_tokens": b.prompt_tokens + b.completion_tokens,
                  "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens_details": {"reasoning_tokens": 0}},
        "metadata": b.meta,
        "model": b.shards[0]["model"] if b.shards else None,
        "e31": {"array_id": b.array_id,
                "shards": [{"model": s["model"], "requests": s["count"]} for s in b.shards]},
    }


def router(settings: Settings, svc: BatchService, models: ModelService) -> APIRouter:
    """The routes of `/v1/batches` and the models'; the windows are this pool's
    (`batch_windows`)."""
    r = APIRouter()
    window = Literal[tuple(settings.batch_windows)]  # type: ignore[valid-type]

    class NewBatch(BaseModel):
        """OpenAI's body of `POST /v1/batches`; fields newer clients add are ignored."""

        model_config = ConfigDict(extra="ignore", strict=True)
        input_file_id: str = Field(max_length=64)
        endpoint: Endpoint
        completion_window: window = Field(  # type: ignore[valid-type]
            description="24h as OpenAI, or another window the pool allows")
        metadata: dict[str, str] | None = None

    @r.post(BATCHES_PATH, tags=["batches"],
            responses=errors.responses(401, 404, 409, 413, 422, 429, 503, openai=True))
    def create_batch(body: NewBatch, t: Caller) -> dict[str, Any]:
        """A batch over an uploaded file: it runs, or fails validation naming the lines."""
        return batch_object(svc.create(t, input_file_id=body.input_file_id,
                                       endpoint=body.endpoint,
                                       completion_window=body.completion_window,
                                       metadata=body.metadata))

    @r.get(BATCHES_PATH, tags=["batches"], responses=errors.responses(401, 422, 503, openai=True))
    def list_batches(t: Caller,
                     limit: Annotated[int, Query(ge=1, le=LIST_MAX), DIGITS] = 20,
                     after: Annotated[str | None, Query(max_length=64)] = None
                     ) -> dict[str, Any]:
        """Your batches, newest first."""
        return listing([batch_object(b) for b in svc.list(t, limit=limit, after=after)], limit)

    @r.get(BATCHES_PATH + "/{batch_id}", tags=["batches"],
           responses=errors.responses(401, 404, 422, 503, openai=True))
    def get_batch(batch_id: str, t: Caller) -> dict[str, Any]:
        return batch_object(svc.get(t, batch_id))

    @r.post(BATCHES_PATH + "/{batch_id}/cancel", tags=["batches"],
            responses=errors.responses(401, 404, 422, 503, openai=True))
    def cancel_batch(batch_id: str, t: Caller) -> dict[str, Any]:
        """Cancel it: `cancelling`, then `cancelled` with what its shards finished."""
        return batch_object(svc.cancel(t, batch_id))

    @r.get("/v1/models", tags=["batches"], responses=errors.responses(401, 503, openai=True))
    def list_models(t: Caller) -> dict[str, Any]:
        """The models a batch's requests may name."""
        return {"object": "list", "data": [m.to_dict() for m in models.list()]}

    @r.post("/v1/admin/models", status_code=201, tags=["admin"],
            responses=errors.responses(401, 403, 409, 413, 422, 503, openai=True))
    def add_model(body: NewModel, t: Caller, request: Request) -> dict[str, Any]:
        """Register a model by name (admins; written to the audit log)."""
        return models.add(t, body.name, body.path, kind=body.kind, gpu_mem_gb=body.gpu_mem_gb,
                          replace=body.replace, actor=actor(request, t)).to_dict()

    @r.delete("/v1/admin/models/{name}", status_code=204, tags=["admin"],
              responses=errors.responses(401, 403, 404, 422, 503, openai=True))
    def remove_model(name: str, t: Caller, request: Request) -> Response:
        models.remove(t, name, actor=actor(request, t))
        return Response(status_code=204)

    return r

