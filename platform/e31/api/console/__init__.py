"""The console: `/ui`, web pages over the same services as the JSON API (docs/console.md).

Signed in through a login form with a tenant's or an admin's token (`session`: an HttpOnly,
SameSite=Strict cookie, never a token in a URL); each page calls the service its JSON route
calls, with the signed-in tenant, so what it shows is what `/v1/...` answers that token
(STYLE.md rule 14). `pages` are the views, `actions` the forms (login, logout, cancel, retry,
each with its CSRF token), `live` the log that follows a running job and the outputs'
downloads. Templates (Jinja2) and a hand-written stylesheet ship in the package: no build
step, nothing fetched from elsewhere at run time.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import RedirectResponse, Response
from fastapi.staticfiles import StaticFiles

from e31.api import errors
from e31.api.console import actions, live, pages
from e31.api.console.render import Renderer
from e31.api.console.session import Sessions, SignedOut
from e31.core.errors import E31Error
from e31.edge.settings import Settings

PREFIX = "/ui"
HERE = Path(__file__).parent


def install(app: FastAPI, settings: Settings) -> None:
    """Add the console's routes, its static files and its answers to errors on its pages (an
    HTML page; the JSON routes keep theirs)."""
    view = Renderer(Sessions(settings), HERE / "templates")
    app.include_router(actions.router(view))
    app.include_router(live.router(view))
    app.include_router(pages.router(view))
    app.mount(f"{PREFIX}/static", StaticFiles(directory=HERE / "static"), name="console-static")
    app.add_exception_handler(SignedOut, _to_login)
    for cls, status_of in ((E31Error, _e31_status), (RequestValidationError, _invalid_status)):
        app.add_exception_handler(cls, _as_page(view, app.exception_handlers[cls], status_of))


async def _to_login(request: Request, exc: Exception) -> Response:
    return RedirectResponse(f"{PREFIX}/login", status_code=303)


def _e31_status(exc: Exception) -> int:
    return next((code for cls, code, _ in errors.STATUS if isinstance(exc, cls)), 500)


def _invalid_status(exc: Exception) -> int:
    return 422


def _as_page(view: Renderer, json_answer: Any, status_of: Any) -> Any:
    """An exception handler that answers a console page's error with the error page, and
    any other route's with the JSON answer it had."""
    async def handle(request: Request, exc: Exception) -> Any:
        if not request.url.path.startswith(f"{PREFIX}/"):
            answer = json_answer(request, exc)
            return await answer if inspect.isawaitable(answer) else answer
        status = status_of(exc)
        return view.error(request, status, "That request is not one this page takes."
                          if status == 422 else str(exc))
    return handle
