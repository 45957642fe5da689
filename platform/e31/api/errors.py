"""The one place where E31 errors become HTTP answers, and the OpenAPI description of them.

Every refusal has the same body (`ErrorBody`): `error`, a stable code, and `message`; a refused
spec adds `errors` (each field and why), a body over a limit adds `limit_bytes`. Which status
means what (docs/jobs.md, "Status codes"):

- 401: no valid token. 403: a valid token asking for what it may not have (an admin's view, a
  file:// input the pool does not open to tenants). 404: no such job, array, output or bundle
  of the caller's tenant (another tenant's answers exactly as a missing one).
- 409: a well-formed request that conflicts with what the store holds (a dependency or bundle
  the tenant lacks, a dependency that failed, a bundle body whose hash is not its name).
- 413: a body over its limit. 422: a request that breaks the OpenAPI schema (a body that is
  not JSON included), or a priority or array over the tenant's limit. 429: the tenant is past
  its submit rate or holds its most queued jobs (`Retry-After`). 503: the results store cannot
  be reached, or secrets are asked of a pool without a secrets key.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException
from starlette.routing import BaseRoute, Match

from e31.core.errors import (
    AuthError,
    Conflict,
    E31Error,
    Forbidden,
    LimitExceeded,
    NotFound,
    SecretsUnavailable,
    SpecConflict,
    SpecError,
    SpecForbidden,
    StoreUnavailable,
    TooLarge,
)
from e31.core.spec import describe_error

REQUEST_PARTS = ("body", "query", "path")
STATUS: list[tuple[type[E31Error], int, str]] = [   # the first class that matches wins
    (SpecConflict, 409, "spec_conflict"),
    (SpecForbidden, 403, "spec_forbidden"),
    (SpecError, 422, "spec_invalid"),
    (TooLarge, 413, "too_large"),
    (AuthError, 401, "unauthorized"),
    (Forbidden, 403, "forbidden"),
    (NotFound, 404, "not_found"),
    (Conflict, 409, "conflict"),
    (StoreUnavailable, 503, "store_unavailable"),
    (LimitExceeded, 429, "limit_exceeded"),
    (SecretsUnavailable, 503, "secrets_unavailable"),
]
REQUEST_TOO_LARGE = "request_too_large"
RETRY_AFTER_S = 5
# FastAPI answers 400 when a body cannot be decoded at all (not UTF-8); to a client that is
# the same mistake as a body that is not JSON, which FastAPI answers 422.
UNREADABLE_BODY = "must be JSON text in UTF-8"

# Starlette's own refusals (no such route; a route without that method) in the same body.
ROUTING = {404: ("not_found", "no such route"), 405: ("method_not_allowed", "")}

ErrorCode = Literal["spec_conflict", "spec_forbidden", "spec_invalid", "too_large",
                    "request_too_large", "unauthorized", "forbidden", "not_found", "conflict",
                    "store_unavailable", "method_not_allowed", "limit_exceeded",
                    "secrets_unavailable"]


class FieldError(BaseModel):
    """One refused field of a request: `resources.gpus`, `items[3].after[0]`."""

    field: str
    reason: str


class ErrorBody(BaseModel):
    """What every refusal answers (but on the OpenAI-compatible routes: `OpenAIErrorBody`)."""

    error: ErrorCode = Field(description="a stable code for the kind of refusal")
    message: str = Field(description="what went wrong, for a person")
    errors: list[FieldError] | None = Field(
        default=None, description="each refused field and why (422, 409 and 403 on a spec)")
    limit_bytes: int | None = Field(default=None, description="the limit passed (413)")


class OpenAIError(BaseModel):
    """OpenAI's error object: what its official client reads and shows."""

    message: str
    type: str = Field(description="the stable code, as ErrorBody's error")
    param: str | None = Field(description="the first refused field, if any")
    code: str | None


class OpenAIErrorBody(BaseModel):
    """What a refusal answers on the OpenAI-compatible routes (`OPENAI_PATHS`): OpenAI's
    `error` object, with the same `message`, `errors` and `limit_bytes` as `ErrorBody`."""

    error: OpenAIError
    message: str
    errors: list[FieldError] | None = None
    limit_bytes: int | None = None


# The OpenAI-compatible routes (docs/workloads.md): their refusals are shaped as OpenAI's, so
# that its client shows the message.
OPENAI_PATHS = ("/v1/files", "/v1/batches", "/v1/models", "/v1/admin/models")


def openai_path(path: str) -> bool:
    return path.startswith(OPENAI_PATHS)


DESCRIPTIONS = {
    401: "No valid token: send 'Authorization: Bearer <token>'.",
    403: "The token is valid but may not have this (an admin's view; a file:// input the pool "
         "does not open to tenants).",
    404: "No such job, array, output or bundle of your tenant (another tenant's answers the "
         "same).",
    409: "Well formed, but in conflict with what the store holds: a dependency or bundle your "
         "tenant lacks, a dependency that failed, a body whose sha256 is not its name.",
    413: "The body is larger than its limit (limit_bytes).",
    422: "The request breaks this schema: each refused field is named in errors.",
    429: "The tenant is past its submit rate or holds its most queued jobs (a limit per "
         "tenant, named in message); try again after Retry-After seconds.",
    503: "The results store cannot be reached (or, for secrets, the pool has no secrets key); "
         "try again after Retry-After seconds.",
}


def responses(*codes: int, openai: bool = False) -> dict[int | str, dict[str, Any]]:
    """The error answers a route can give, for its `responses=` (the OpenAPI document);
    `openai`: shaped as OpenAI's (`OpenAIErrorBody`)."""
    out: dict[int | str, dict[str, Any]] = {}
    for code in codes:
        out[code] = {"model": OpenAIErrorBody if openai else ErrorBody,
                     "description": DESCRIPTIONS[code]}
        if code == 401:
            out[code]["headers"] = {"WWW-Authenticate": {"schema": {"type": "string"}}}
        if code in (429, 503):
            out[code]["headers"] = {"Retry-After": {"schema": {"type": "integer"}}}
    return out


class BodyTooLarge(HTTPException):
    """Raised when a request's body passes `max_request_bytes` while it is read. An HTTP
    exception, not an `E31Error`: FastAPI lets only those out of its reading of a body."""

    def __init__(self, limit_bytes: int) -> None:
        super().__init__(status_code=413, detail=_too_large_message(limit_bytes))
        self.limit_bytes = limit_bytes


def _too_large_message(limit_bytes: int) -> str:
    return f"the request body is larger than {limit_bytes} bytes (max_request_bytes)"


def too_large(limit_bytes: int, *, openai: bool = False) -> JSONResponse:
    """The 413 answer to a body over the limit, which it names (`limit_bytes`)."""
    body: dict[str, Any] = {"error": REQUEST_TOO_LARGE,
                            "message": _too_large_message(limit_bytes),
                            "limit_bytes": limit_bytes}
    return JSONResponse(_openai(body) if openai else body, status_code=413)


def _openai(body: dict[str, Any]) -> dict[str, Any]:
    """`body` (an `ErrorBody`) as an `OpenAIErrorBody`."""
    fields = body.get("errors") or []
    return {**body, "error": {"message": body["message"], "type": body["error"],
                              "param": fields[0]["field"] if fields else None,
                              "code": body["error"]}}


def _answer(exc: E31Error, *, openai: bool = False) -> JSONResponse:
    """The HTTP answer to `exc`, by `STATUS` (500 for an error no status names); `openai`:
    shaped as OpenAI's."""
    for cls, status, code in STATUS:
        if isinstance(exc, cls):
            body: dict[str, Any] = {"error": code, "message": exc.message}
            if isinstance(exc, SpecError):
                body["errors"] = exc.errors
            if isinstance(exc, TooLarge):
                body["limit_bytes"] = exc.limit_bytes
            if openai:
                body = _openai(body)
            headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
            if status == 503:
                headers = {"Retry-After": str(RETRY_AFTER_S)}
            if isinstance(exc, LimitExceeded):
                headers = {"Retry-After": str(exc.retry_after_s)}
            return JSONResponse(body, status_code=status, headers=headers)
    return JSONResponse({"error": "internal", "message": exc.message}, status_code=500)


def install(app: FastAPI) -> None:
    """Answer every `E31Error`, and FastAPI's own refusal of a request's input, by `STATUS`;
    a body over the limit with `too_large`."""

    @app.exception_handler(E31Error)
    async def _e31(request: Request, exc: E31Error) -> JSONResponse:
        return _answer(exc, openai=openai_path(request.url.path))

    @app.exception_handler(BodyTooLarge)
    async def _too_large(request: Request, exc: BodyTooLarge) -> JSONResponse:
        return too_large(exc.limit_bytes, openai=openai_path(request.url.path))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _answer(SpecError([describe_error({**e, "loc": _field_path(e)})
                                 for e in exc.errors()]), openai=openai_path(request.url.path))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 400:      # a body FastAPI could not decode
            return _answer(SpecError.one("body", UNREADABLE_BODY),
                           openai=openai_path(request.url.path))
        if exc.status_code not in ROUTING:
            return await http_exception_handler(request, exc)
        code, message = ROUTING[exc.status_code]
        headers = dict(exc.headers or {})
        if exc.status_code == 405:      # every method of the path, not only one route's
            allowed = _allowed_methods(request)
            headers["Allow"] = ", ".join(allowed)
            message = f"{request.method} is not one of {', '.join(allowed)} on this path"
        return JSONResponse({"error": code, "message": message}, status_code=exc.status_code,
                            headers=headers)


def _allowed_methods(request: Request) -> list[str]:
    """The methods of every route whose path matches the request's (a path such as /v1/jobs has
    a route per method, and Starlette's 405 names only the first one's)."""
    methods: set[str] = set()
    for route in _routes(request.app.router.routes):
        match, _ = route.matches(request.scope)
        if match is not Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return sorted(methods)


def _routes(routes: Sequence[BaseRoute]) -> Iterator[BaseRoute]:
    """`routes` with the routes of each included router in its place: FastAPI keeps an included
    router as one entry (`original_router`) that names no methods of its own."""
    for route in routes:
        included = getattr(route, "original_router", None)
        if included is not None:
            yield from _routes(included.routes)
        else:
            yield route


def _field_path(error: Mapping[str, Any]) -> list[Any]:
    """The error's location without FastAPI's part of the request (`body`, `query`, `path`),
    so a field is named as the spec names it: `resources.gpus`, not `body.resources.gpus`."""
    return [p for p in error.get("loc", ()) if p not in REQUEST_PARTS]
