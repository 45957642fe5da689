"""What one request may carry: the body-size limit, the caps on specs, strict query numbers.

The body limit is an ASGI middleware, so a body over `max_request_bytes` is refused while it
arrives: at once when its Content-Length says so, else (a chunked body) as soon as the bytes
read pass the limit. The API therefore never holds more than the limit of one body, however
much a client sends. The caps on what the specs carry (`SpecLimits`) come from the same
settings; the service applies them. docs/security.md ("Limits and quotas") lists them all.

The middleware also notes how many bytes a body had (`body_bytes`), so that the service can hold
a submit to its tenant's own, smaller `max_request_bytes` once the token names the tenant; and
`SubmitRate` is the tenant's submit-rate token bucket, kept in Redis so that every API process
draws from the same one.
"""

from __future__ import annotations

import logging
import math
import re
from typing import Annotated, Any

import redis
from fastapi import Request
from pydantic import BeforeValidator
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from e31.api.errors import BodyTooLarge, openai_path, too_large
from e31.core import keys
from e31.core.errors import LimitExceeded
from e31.core.requestlimits import SpecLimits
from e31.core.tenantlimits import TenantLimits
from e31.edge.settings import Settings

# A number in a query is decimal digits only: int() would also forgive a sign, spaces, `_`
# and `1.0`. Twenty digits hold any value the routes allow and stop a 10,000-digit parse.
_DIGITS = re.compile(r"[0-9]{1,20}")
_BOOLEANS = ("true", "false")
BODY_BYTES = "e31_body_bytes"    # the request's state: how many bytes its body had

log = logging.getLogger(__name__)


def spec_limits(settings: Settings) -> SpecLimits:
    """The caps on specs that `settings` set (`max_env_vars` …)."""
    return SpecLimits(env_vars=settings.max_env_vars, env_bytes=settings.max_env_bytes,
                      argv_bytes=settings.max_argv_bytes,
                      after_per_request=settings.max_after_per_request,
                      spec_bytes_per_request=settings.max_spec_bytes_per_request,
                      disk_gb=settings.attempt_disk_max_gb)


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

    def __init__(self, app: ASGIApp, *, max_bytes: int, exempt: tuple[str, ...] = (),
                 only: tuple[str, ...] = ()) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.exempt = exempt    # path prefixes whose routes bound their bodies themselves
        self.only = only        # if given, the path prefixes it bounds (and no other)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].startswith(self.exempt) \
                or (self.only and not scope["path"].startswith(self.only)):
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await too_large(self.max_bytes, openai=openai_path(scope["path"]))(
                scope, receive, send)
            return
        seen = 0
        started = False
        state = scope.setdefault("state", {})
        state[BODY_BYTES] = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                state[BODY_BYTES] = seen
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
            await too_large(self.max_bytes, openai=openai_path(scope["path"]))(
                scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    value = Headers(scope=scope).get("content-length")
    return int(value) if value is not None and value.isdigit() else None


def body_bytes(request: Request) -> int:
    """How many bytes the request's body had (noted by `BodyLimit` while it was read)."""
    return int(request.scope.get("state", {}).get(BODY_BYTES, 0))


# A token bucket in one Redis hash: `tokens` left as of `at` (Redis's own clock, so every API
# process agrees), refilled at ARGV[1] a second up to ARGV[2]. One request takes one token;
# the answer is {1, 0} when it may go, {0, seconds until a token} when not. One script, so
# concurrent requests of several API processes each see the other's draw.
_BUCKET = """
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local held = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = tonumber(held[1]) or burst
local at = tonumber(held[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - at) * rate)
local ok, wait = 1, 0
if tokens >= 1 then tokens = tokens - 1 else ok = 0; wait = (1 - tokens) / rate end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
return {ok, tostring(wait)}
"""


class SubmitRate:
    """Each tenant's submit rate: `take` refuses a submit past `submit_rate_per_s` (with
    `submit_burst` at once) with `LimitExceeded` (429) and the seconds to wait. Without Redis
    the submit goes on (logged): the store is the record of jobs, the rate only a guard."""

    def __init__(self, redis_client: redis.Redis) -> None:
        self._script = redis_client.register_script(_BUCKET)

    def take(self, tenant_id: str, tenant_name: str, limits: TenantLimits) -> None:
        try:
            ok, wait = self._script(keys=[keys.submit_rate(tenant_id)],
                                    args=[repr(limits.submit_rate_per_s), limits.submit_burst])
        except redis.RedisError as exc:
            log.warning("submit_rate_unchecked tenant=%s: %s", tenant_name, exc)
            return
        if int(ok):
            return
        raise LimitExceeded(
            f"tenant {tenant_name} submits faster than {limits.submit_rate_per_s:g} requests a "
            f"second (limits.submit_rate_per_s; {limits.submit_burst} at once: "
            "limits.submit_burst); try again after Retry-After seconds, or submit an array",
            retry_after_s=math.ceil(float(wait)))
