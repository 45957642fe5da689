"""What one request may carry: the body-size limit, the caps on specs, strict query numbers.

The body limit is an ASGI middleware, so a body over `max_request_bytes` is refused while it
arrives: at once when its Content-Length says so, else (a chunked body) as soon as the bytes
read pass the limit. The API therefore never holds more than the limit of one body, however
much a client sends. The caps on what the specs carry (`SpecLimits`) come from the same
settings; the service applies them. docs/security.md ("Limits and quotas") lists them all.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BeforeValidator
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from e31.api.errors import BodyTooLarge, too_large
from e31.settings import Settings
from e31.spec import SpecLimits

# A number in a query is decimal digits only: int() would also forgive a sign, spaces, `_`
# and `1.0`. Twenty digits hold any value the routes allow and stop a 10,000-digit parse.
_DIGITS = re.compile(r"[0-9]{1,20}")
_BOOLEANS = ("true", "false")


def spec_limits(settings: Settings) -> SpecLimits:
    """The caps on specs that `settings` set (`max_env_vars` …)."""
    return SpecLimits(env_vars=settings.max_env_vars, env_bytes=settings.max_env_bytes,
                      argv_bytes=settings.max_argv_bytes,
                      after_per_request=settings.max_after_per_request,
                      spec_bytes_per_request=settings.max_spec_bytes_per_request)


def _decimal(value: Any) -> Any:
    if isinstance(value, str) and not _DIGITS.fullmatch(value):
        raise ValueError("must be a whole number in decimal digits")
    return value


def _true_false(value: Any) -> Any:
    if isinstance(value, str) and value not in _BOOLEANS:
        raise ValueError("must be true or false")
    return value


DIGITS = BeforeValidator(_decimal)
"""Placed after `Query(...)` on an integer query parameter (`Annotated[int, Query(ge=1), DIGITS]`:
an alias that nests Annotated would hide the bounds from the OpenAPI schema): `?limit=10`,
never `?limit=1_0`, `?limit=+10` or `?limit=10.0`."""
QueryBool = Annotated[bool, BeforeValidator(_true_false)]
"""A boolean query parameter: `true` or `false`, never `1`, `yes` or `on`."""


class BodyLimit:
    """ASGI middleware: refuse a request body of more than `max_bytes` with 413, before or while
    it is read (see the module's docstring)."""

    def __init__(self, app: ASGIApp, *, max_bytes: int, exempt: tuple[str, ...] = ()) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.exempt = exempt    # path prefixes whose routes bound their bodies themselves

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].startswith(self.exempt):
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await too_large(self.max_bytes)(scope, receive, send)
            return
        seen = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, watched_send)
        except BodyTooLarge:
            # The routes' handler answers it (errors.install); this is for a read elsewhere.
            if started:
                raise
            await too_large(self.max_bytes)(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    value = Headers(scope=scope).get("content-length")
    return int(value) if value is not None and value.isdigit() else None
