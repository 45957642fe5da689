"""`GET /v1/top`: one snapshot of the pool for `e31 top` (`e31.api.services.top` shapes it)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from e31.api import errors
from e31.api.auth import Caller
from e31.api.services.top import TopService

PATH = "/v1/top"


def router(svc: TopService) -> APIRouter:
    """The `/v1/top` route (401 without a token)."""
    r = APIRouter()

    @r.get(PATH, tags=["queue"], responses=errors.responses(401, 503))
    def top(t: Caller) -> dict[str, Any]:
        """The pool now: classes, GPUs, running jobs (yours, or all with an admin token)."""
        return svc.top(t)

    return r
