"""`GET /v1/queue`: the shared pool's queues as the caller may see them
(`e31.api.services.queue`)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from e31.api import errors
from e31.api.auth import Caller
from e31.api.services.queue import QueueService


def router(svc: QueueService) -> APIRouter:
    """The `/v1/queue` route."""
    r = APIRouter()

    @r.get("/v1/queue", tags=["queue"], responses=errors.responses(401, 503))
    def queue(t: Caller) -> dict[str, Any]:
        """Per size class: GPUs, busy GPUs, queued jobs and running GPUs per tenant, each
        tenant's share of running GPUs against its share of weight (others merged unless admin)."""
        return svc.overview(t)

    return r
