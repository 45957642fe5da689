"""`GET /v1/health`: the API answers, and with which version (no token needed)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from e31 import __version__


def router() -> APIRouter:
    """The health route."""
    r = APIRouter()

    @r.get("/v1/health", tags=["ops"])
    def health() -> dict[str, Any]:
        return {"ok": True, "version": __version__}

    return r
