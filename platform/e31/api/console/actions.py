"""The console's forms: sign in and out, cancel a job, retry an array's failed items. Each
POST but the login carries the session's CSRF token (`session.Sessions.check_csrf`) and then
calls the service the JSON route calls."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from e31.api.console.render import Renderer
from e31.api.console.session import SignedOut
from e31.core.errors import AuthError, Forbidden

_Csrf = Annotated[str | None, Form(max_length=128)]
TOKEN_MAX_CHARS = 512


def router(view: Renderer) -> APIRouter:
    """The login form and the POSTs of `/ui`."""
    r = APIRouter(include_in_schema=False)

    @r.get("/ui/login", response_class=HTMLResponse)
    def login_form(request: Request) -> HTMLResponse:
        return view.page(request, "login.html", None, message=None)

    @r.post("/ui/login", response_class=HTMLResponse)
    def login(request: Request,
              token: Annotated[str, Form(max_length=TOKEN_MAX_CHARS)] = "") -> Response:
        """Check the token as the API does (`TokenService.authenticate`); a good one gets the
        session cookie and the jobs page, a bad one the form again with one same answer."""
        token = token.strip()
        try:
            view.services(request).tokens.authenticate(token)
        except Forbidden as exc:   # a disabled tenant's token: only its holder learns it
            return view.page(request, "login.html", None, status=403, message=str(exc))
        except AuthError:
            return view.page(request, "login.html", None, status=401,
                             message="That token is not valid (unknown, revoked or expired).")
        response = RedirectResponse("/ui/jobs", status_code=303)
        view.sessions.sign_in(request, response, token)
        return response

    @r.post("/ui/logout")
    def logout(request: Request, csrf: _Csrf = None) -> Response:
        try:
            viewer = view.sessions.viewer(request)
        except SignedOut:
            viewer = None
        if viewer is not None:
            view.sessions.check_csrf(viewer, csrf)
        response = RedirectResponse("/ui/login", status_code=303)
        view.sessions.sign_out(response)
        return response

    @r.post("/ui/jobs/{job_id}/cancel")
    def cancel(request: Request, job_id: str, csrf: _Csrf = None) -> Response:
        viewer = view.sessions.viewer(request)
        view.sessions.check_csrf(viewer, csrf)
        view.services(request).jobs.cancel(viewer.tenant, job_id)
        return RedirectResponse(f"/ui/jobs/{job_id}", status_code=303)

    @r.post("/ui/arrays/{array_id}/retry")
    def retry(request: Request, array_id: str, csrf: _Csrf = None) -> Response:
        viewer = view.sessions.viewer(request)
        view.sessions.check_csrf(viewer, csrf)
        view.services(request).arrays.retry(viewer.tenant, array_id)
        return RedirectResponse(f"/ui/arrays/{array_id}", status_code=303)

    return r
