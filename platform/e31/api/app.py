"""FastAPI app factory (`/v1/...`, OpenAPI at `/docs` and `/openapi.json`).

`create_app` only assembles: the services (`e31.api.services`, one per noun) on the app's state,
where the `Caller` dependency (`e31.api.auth`) finds the token service; the one mapping of
errors to HTTP answers (`errors`); the document's rules (`schema`); the routers, one per noun
(`e31.api.routes`); and the middleware. What arrives is bounded and typed strictly
(`requestlimits`): a body over `max_request_bytes` is refused while it is read, and query
numbers are digits only.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from e31 import __version__
from e31.api import console, errors, schema
from e31.api.requestlimits import BodyLimit
from e31.api.routes import (
    arrays,
    batches,
    bundles,
    files,
    health,
    jobs,
    metrics,
    queue,
    secrets,
    tenants,
    tokens,
    top,
    usage,
)
from e31.api.services import Services
from e31.edge import wiring
from e31.edge.settings import Settings

FORM_OVERHEAD_BYTES = 64 * 1024   # a multipart form's headers and boundaries around its file
# Each Redis call of a request, and each connection to Redis, gives up after this long: a Redis
# that is down, or stopped and still accepting connections, then costs a request seconds and
# an answer without it ("broker unreachable"), never a request held for ever.
REDIS_TIMEOUT_S = 2.0


def _settling(services: Services) -> Any:
    """The app's lifespan: the batches' settling loop (`BatchEnds.run`) on a thread of its
    own while the app serves."""
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        stop = threading.Event()
        thread = threading.Thread(target=services.batch_ends.run, args=(stop,),
                                  name="e31-batch-settle", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=10)
    return lifespan


def create_app(settings: Settings, *, services: Services | None = None) -> FastAPI:
    """The API over the store, artifacts and Redis named in `settings` (or over `services`)."""
    if services is None:
        services = Services(settings=settings, repo=wiring.repo(settings),
                            artifacts=wiring.artifacts(settings),
                            redis_client=wiring.redis_client(
                                settings, socket_timeout_s=REDIS_TIMEOUT_S,
                                connect_timeout_s=REDIS_TIMEOUT_S))
    app = FastAPI(title="E31 Batch", version=__version__, lifespan=_settling(services),
                  description="Batch GPU jobs on a shared pool. Authenticate with a tenant token.")
    app.state.services = services
    app.state.job_ends = services.job_ends   # the long polls' listener, closed with the app
    errors.install(app)
    schema.install(app, settings)
    app.include_router(health.router())
    app.include_router(jobs.router(services.jobs))
    app.include_router(arrays.router(services.arrays))
    app.include_router(queue.router(services.queue))
    app.include_router(usage.router(services.usage))
    app.include_router(bundles.router(services.bundles))   # bounded by bundle_max_bytes itself
    app.include_router(top.router(services.top))
    app.include_router(tokens.router(services.tokens))
    app.include_router(tenants.router(settings, services.tenants))   # the admin API
    app.include_router(secrets.router(services.secrets))
    app.include_router(metrics.router(settings, services.metrics))   # its own guard
    app.include_router(files.router(services.files))   # bounded by batch_file_max_bytes
    app.include_router(batches.router(settings, services.batches, services.models))
    console.install(app, settings)   # /ui: pages over the same services (docs/console.md)
    # Added before the header middleware, so it runs inside it: a 413 carries the header too.
    app.add_middleware(BodyLimit, max_bytes=settings.max_request_bytes,
                       exempt=(bundles.BUNDLES_PATH, files.FILES_PATH))
    app.add_middleware(BodyLimit, max_bytes=settings.batch_file_max_bytes + FORM_OVERHEAD_BYTES,
                       only=(files.FILES_PATH,))
    app.add_middleware(VersionHeader)
    return app


class VersionHeader:
    """ASGI middleware: every HTTP answer says the API's version (`X-E31-Version`). Plain ASGI
    rather than `@app.middleware("http")`, whose `BaseHTTPMiddleware` wraps each request in a
    task group and memory streams: a cost per request on the control path (issue 31)."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return

        async def send_with_version(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["X-E31-Version"] = __version__
            await send(message)

        await self._app(scope, receive, send_with_version)
