"""`GET /v1/queue`: the shared pool's queues as the caller may see them, and
`GET /v1/pool/environments`: the Python environments of the workers a job would run on
(`e31.api.services.queue`)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from e31.api import errors
from e31.api.auth import Caller
from e31.api.requestlimits import DIGITS
from e31.api.services.queue import QueueService


def router(svc: QueueService) -> APIRouter:
    """The `/v1/queue` and `/v1/pool/environments` routes."""
    r = APIRouter()

    @r.get("/v1/queue", tags=["queue"], responses=errors.responses(401, 503))
    def queue(t: Caller) -> dict[str, Any]:
        """Per size class: GPUs, busy GPUs, queued jobs and running slots per tenant (`running`:
        GPUs, or a CPU class's jobs; `running_gpus`: GPUs alone), each tenant's share of the
        running slots against its share of weight (others merged unless admin)."""
        return svc.overview(t)

    @r.get("/v1/pool/environments", tags=["queue"], responses=errors.responses(401, 422, 503))
    def environments(t: Caller, gpus: Annotated[int, Query(ge=0, le=64), DIGITS] = 0,
                     gpu_mem_gb: Annotated[float | None, Query(ge=0, le=100_000)] = None,
                     size_class: Annotated[str | None, Query(max_length=32)] = None,
                     ) -> dict[str, Any]:
        """The distinct Python environments (Python, installed distributions' versions, the
        top-level modules they can import as `modules`) of the live workers serving the queue
        a job of these resources waits in, each with its number of workers; `unknown`: those
        serving it whose environment is not known; `refused`, with no environment, for
        resources no size class takes."""
        resources: dict[str, Any] = {"gpus": gpus}
        if gpu_mem_gb is not None:
            resources["gpu_mem_gb"] = gpu_mem_gb
        if size_class is not None:
            resources["size_class"] = size_class
        return svc.environments(resources)

    return r
