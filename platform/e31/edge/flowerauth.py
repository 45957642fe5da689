"""Flower behind its credentials on every route, `/metrics` and `/healthcheck` included.

Flower (checked with 2.2.0) applies `--basic-auth` only in the handlers it decorates with
`tornado.web.authenticated`: its `/metrics` (every tenant's task names and counts, every
worker's name), `/healthcheck`, static files, login page and 404s answer anyone, and it has no
option to change that. `run` starts Flower's own command, so its options, `FLOWER_*`
variables, config file and logging stay Flower's, with `flower.command.Flower` (the Tornado
application that command builds) replaced by `GuardedFlower`: a subclass that answers 401
to any request without the credentials before a route is even looked up. Without
`--basic-auth` it answers 401 to everything rather than serve anyone.
`tests/integration/test_flower_auth.py` checks a real Flower process, and that Flower's own
`/metrics` answers without them.
"""

from __future__ import annotations

import base64
import binascii
import hmac
from collections.abc import Sequence
from typing import Any

import tornado.httputil
import tornado.web
from celery import Celery
from flower import command
from flower.app import Flower

REALM = 'Basic realm="flower"'   # what Flower's own 401 asks for


class Unauthorized(tornado.web.RequestHandler):
    """The answer to every request without the credentials: 401, nothing else."""

    def check_xsrf_cookie(self) -> None:
        """Refused anyway: a POST gets the same 401, not Tornado's 403 for a missing cookie."""

    def prepare(self) -> None:
        self.set_status(401)
        self.set_header("WWW-Authenticate", REALM)
        self.finish("Access denied")


class GuardedFlower(Flower):
    """Flower's application, refusing every request that lacks its basic-auth credentials."""

    def find_handler(self, request: tornado.httputil.HTTPServerRequest,
                     **kwargs: Any) -> tornado.web._HandlerDelegate:
        if not authorized(request.headers.get("Authorization", ""),
                          self.options.basic_auth or ()):
            return self.get_handler_delegate(request, Unauthorized)
        delegate: tornado.web._HandlerDelegate = super().find_handler(request, **kwargs)
        return delegate


def authorized(header: str, credentials: Sequence[str]) -> bool:
    """Whether an `Authorization` header carries one of `credentials` (`user:password`),
    compared in constant time; never with no credentials configured."""
    scheme, _, encoded = header.partition(" ")
    if scheme != "Basic" or not credentials:
        return False
    try:
        given = base64.b64decode(encoded.strip(), validate=True)
    except (binascii.Error, ValueError):
        return False
    return any(hmac.compare_digest(given, c.encode()) for c in credentials)


def run(app: Celery, argv: Sequence[str]) -> None:
    """`celery flower ARGV` on `app`, with every route behind the credentials."""
    command.Flower = GuardedFlower
    app.start(["flower", *argv])
