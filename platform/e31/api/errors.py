"""The one place where E31 errors become HTTP answers."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from e31.errors import AuthError, Conflict, E31Error, NotFound, SpecError, StoreUnavailable
from e31.spec import describe_error

STATUS: list[tuple[type[E31Error], int, str]] = [
    (SpecError, 422, "spec_invalid"),
    (AuthError, 401, "unauthorized"),
    (NotFound, 404, "not_found"),
    (Conflict, 409, "conflict"),
    (StoreUnavailable, 503, "store_unavailable"),
]


def _answer(exc: E31Error) -> JSONResponse:
    for cls, status, code in STATUS:
        if isinstance(exc, cls):
            body: dict[str, object] = {"error": code, "message": exc.message}
            if isinstance(exc, SpecError):
                body["errors"] = exc.errors
            headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
            if status == 503:
                headers = {"Retry-After": "5"}
            return JSONResponse(body, status_code=status, headers=headers)
    return JSONResponse({"error": "internal", "message": exc.message}, status_code=500)


def install(app: FastAPI) -> None:
    @app.exception_handler(E31Error)
    async def _e31(_: Request, exc: E31Error) -> JSONResponse:
        return _answer(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = []
        for e in exc.errors():
            d = describe_error({**e, "loc": [p for p in e.get("loc", ()) if p not in ("body", "query", "path")]})
            errors.append(d)
        return _answer(SpecError(errors))
