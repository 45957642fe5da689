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
    json_answer = app.exception_handlers[E31Error]

    async def _signed_out(request: Request, exc: Exception) -> Response:
        return RedirectResponse(f"{PREFIX}/login", status_code=303)

    async def _e31(request: Request, exc: Exception) -> Any:
        if not request.url.path.startswith(f"{PREFIX}/"):
            answer = json_answer(request, exc)
            return await answer if inspect.isawaitable(answer) else answer
        status = next((code for cls, code, _ in errors.STATUS if isinstance(exc, cls)), 500)
        return view.error(request, status, str(exc))

    app.add_exception_handler(SignedOut, _signed_out)
    app.add_exception_handler(E31Error, _e31)
