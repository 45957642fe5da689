"""Pages from templates: the Jinja2 environment, the filters the pages share (durations,
sizes, states' colours), and the one error page (a missing job and another tenant's job get
the same)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates

from e31 import __version__
from e31.api.console.session import Sessions, Viewer
from e31.api.services import Services

NOT_FOUND_TEXT = "No such page, or nothing here that this token may see."


def duration(seconds: float | None) -> str:
    """`1h 02m`, `3m 04s`, `5.2s`; an em dash for none."""
    if seconds is None:
        return "—"
    s = float(seconds)
    if s < 60:
        return f"{s:.1f}s"
    m, sec = divmod(int(s), 60)
    if m < 60:
        return f"{m}m {sec:02d}s"
    h, m = divmod(m, 60)
    return f"{h}h {m:02d}m"


def size(n_bytes: float | None) -> str:
    """Bytes in the largest unit under 1024 of it; an em dash for none."""
    if n_bytes is None:
        return "—"
    value = float(n_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def percent(ratio: float | None) -> str:
    return "—" if ratio is None else f"{ratio * 100:.0f}%"


class Renderer:
    """What every console route shares: the sessions, the templates and the services."""

    def __init__(self, sessions: Sessions, templates_dir: Path) -> None:
        self.sessions = sessions
        self._templates = Jinja2Templates(directory=templates_dir)
        env = self._templates.env
        env.filters.update(duration=duration, size=size, percent=percent)
        env.globals["version"] = __version__

    @staticmethod
    def services(request: Request) -> Services:
        services: Services = request.app.state.services
        return services

    def page(self, request: Request, name: str, viewer: Viewer | None, *, status: int = 200,
             **context: Any) -> HTMLResponse:
        """The template `name` with the viewer (None: signed out) and `context`."""
        return self._templates.TemplateResponse(
            request, name, {"viewer": viewer, **context}, status_code=status,
            headers={"Cache-Control": "no-store", "X-Frame-Options": "DENY",
                     "Content-Security-Policy": "default-src 'self'; style-src 'self'; "
                                                "img-src 'self' data:; frame-ancestors 'none'"})

    def error(self, request: Request, status: int, message: str) -> HTMLResponse:
        """The error page; every 404 says the same words, whatever the service said, so a job
        of another tenant is not told apart from one that does not exist."""
        try:
            viewer: Viewer | None = self.sessions.viewer(request)
        except Exception:  # noqa: BLE001 - signed out, or the store is down: a page without a menu
            viewer = None
        text = NOT_FOUND_TEXT if status == 404 else message
        return self.page(request, "error.html", viewer, status=status, status_code=status,
                         message=text)
