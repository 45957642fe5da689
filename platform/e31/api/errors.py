"""The one place where E31 errors become HTTP answers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from e31.errors import (
    AuthError,
    Conflict,
    E31Error,
    NotFound,
    SpecError,
    StoreUnavailable,
    TooLarge,
)
from e31.spec import describe_error

REQUEST_PARTS = ("body", "query", "path")
STATUS: list[tuple[type[E31Error], int, str]] = [
    (SpecError, 422, "spec_invalid"),
    (TooLarge, 413, "too_large"),
    (AuthError, 401, "unauthorized"),
    (NotFound, 404, "not_found"),
    (Conflict, 409, "conflict"),
    (StoreUnavailable, 503, "store_unavailable"),
]


class BodyTooLarge(HTTPException):
    """Raised when a request's body passes `max_request_bytes` while it is read. An HTTP
    exception, not an `E31Error`: FastAPI lets only those out of its reading of a body."""

    def __init__(self, limit_bytes: int) -> None:
        super().__init__(status_code=413, detail=_too_large_message(limit_bytes))
        self.limit_bytes = limit_bytes


def _too_large_message(limit_bytes: int) -> str:
    return f"the request body is larger than {limit_bytes} bytes (max_request_bytes)"


def too_large(limit_bytes: int) -> JSONResponse:
    """The 413 answer to a body over the limit, which it names (`limit_bytes`)."""
    return JSONResponse({"error": "request_too_large", "message": _too_large_message(limit_bytes),
                         "limit_bytes": limit_bytes}, status_code=413)


def _answer(exc: E31Error) -> JSONResponse:
    for cls, status, code in STATUS:
        if isinstance(exc, cls):
            body: dict[str, object] = {"error": code, "message": exc.message}
            if isinstance(exc, SpecError):
                body["errors"] = exc.errors
            if isinstance(exc, TooLarge):
                body["limit_bytes"] = exc.limit_bytes
            headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
            if status == 503:
                headers = {"Retry-After": "5"}
            return JSONResponse(body, status_code=status, headers=headers)
    return JSONResponse({"error": "internal", "message": exc.message}, status_code=500)


def install(app: FastAPI) -> None:
    """Answer every `E31Error`, and FastAPI's own refusal of a request's input, by `STATUS`;
    a body over the limit with `too_large`."""

    @app.exception_handler(E31Error)
    async def _e31(_: Request, exc: E31Error) -> JSONResponse:
        return _answer(exc)

    @app.exception_handler(BodyTooLarge)
    async def _too_large(_: Request, exc: BodyTooLarge) -> JSONResponse:
        return too_large(exc.limit_bytes)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _answer(SpecError([describe_error({**e, "loc": _field_path(e)})
                                  for e in exc.errors()]))


def _field_path(error: Mapping[str, Any]) -> list[Any]:
    """The error's location without FastAPI's part of the request (`body`, `query`, `path`),
    so a field is named as the spec names it: `resources.gpus`, not `body.resources.gpus`."""
    return [p for p in error.get("loc", ()) if p not in REQUEST_PARTS]
