"""FastAPI app factory and routes (`/v1/...`, OpenAPI at `/docs` and `/openapi.json`).

Each route group (jobs, arrays, the pool's queue and usage) is added by a function of its own;
every route names its caller's tenant by the `Caller` dependency and hands typed input to
`Service`, which does the work. What arrives is bounded and typed strictly (`limits`): a body
over `max_request_bytes` is refused while it is read, and query numbers are digits only.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Query, Request, Response
from fastapi.responses import StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from e31 import __version__
from e31.api import errors, metrics, schema, secrets, tenancy, top
from e31.api.bundles import BUNDLES_PATH, add_bundle_routes
from e31.api.limits import DIGITS, BodyLimit, QueryBool, body_bytes
from e31.api.service import LIST_LIMIT_MAX, Service
from e31.api.waits import WAIT_MAX_S, JobEnds
from e31.core.records import TenantRecord
from e31.core.spec import JobSpec
from e31.core.states import FINAL_STATES, JobState
from e31.edge import wiring
from e31.edge.settings import Settings
from e31.ops.sweep import MAX_ARRAY_ITEMS

CHUNK_BYTES = 1 << 20
MAX_LOG_OFFSET = 1 << 40   # far beyond any capped log; bigger numbers are input errors
MAX_ATTEMPT = 10_000
LIST_LIMIT_DEFAULT = 100
# GET …/logs answers one bounded chunk; these say how big the logs are and where the next
# chunk starts (the client, e31.client.handles, reads the same names).
LOG_SIZE_HEADER = "X-E31-Log-Size"
NEXT_OFFSET_HEADER = "X-E31-Next-Offset"
LOG_HEADERS = {
    LOG_SIZE_HEADER: {"description": "the size of the logs asked for, in bytes, as they are now",
                      "schema": {"type": "integer"}},
    NEXT_OFFSET_HEADER: {"description": "the offset of the byte after this chunk",
                         "schema": {"type": "integer"}},
}
_bearer = HTTPBearer(auto_error=False, description="a tenant's API token")
_Token = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def _caller(request: Request, creds: _Token) -> TenantRecord:
    """The tenant whose token the request carries (401 without a valid one)."""
    service: Service = request.app.state.service
    return service.authenticate(creds.credentials if creds else None)


Caller = Annotated[TenantRecord, Depends(_caller)]


class ArraySubmission(BaseModel):
    """N jobs as one array. Items are validated one by one, so an error names its item."""

    model_config = ConfigDict(extra="forbid", strict=True)
    name: str | None = Field(default=None, description="the array's name; items without a name "
                                                       "of their own are called NAME[i]")
    items: list[Any] = Field(description=f"job specs as for POST /v1/jobs, 1 to {MAX_ARRAY_ITEMS}")
    defaults: dict[str, Any] | None = Field(
        default=None, description="spec fields under every item (the item wins; params and env "
                                  "merge key by key)")


def create_app(settings: Settings, *, service: Service | None = None) -> FastAPI:
    """The API over the store, artifacts and Redis named in `settings`."""
    if service is None:
        service = Service(settings=settings, repo=wiring.repo(settings),
                          artifacts=wiring.artifacts(settings),
                          redis_client=wiring.redis_client(settings))
    app = FastAPI(title="E31 Batch", version=__version__,
                  description="Batch GPU jobs on a shared pool. Authenticate with a tenant token.")
    app.state.service = service
    errors.install(app)
    schema.install(app, settings)

    @app.get("/v1/health", tags=["ops"])
    def health() -> dict[str, Any]:
        return {"ok": True, "version": __version__}

    _add_job_routes(app, service)
    _add_array_routes(app, service)
    _add_pool_routes(app, service)
    add_bundle_routes(app, service.bundles, _caller)   # bounded by bundle_max_bytes itself
    app.include_router(top.router(settings, service.repo, service.redis, _caller))
    app.include_router(tenancy.router(settings, service.repo, _caller))   # tokens, admin
    app.include_router(secrets.router(settings, service.repo, _caller))
    app.include_router(metrics.router(settings, service.repo, service.redis))   # own guard
    # Added before the header middleware, so it runs inside it: a 413 carries the header too.
    app.add_middleware(BodyLimit, max_bytes=settings.max_request_bytes, exempt=(BUNDLES_PATH,))

    @app.middleware("http")
    async def _version_header(request: Request, call_next: Any) -> Any:
        response = await call_next(request)
        response.headers["X-E31-Version"] = __version__
        return response

    return app


def _add_job_routes(app: FastAPI, svc: Service) -> None:
    """`/v1/jobs`: submit, list, read, cancel, logs and outputs of one tenant's jobs."""

    @app.post("/v1/jobs", status_code=201, tags=["jobs"], responses={
        200: {"description": "a dry run: what would be stored"},
        **errors.responses(401, 403, 409, 413, 422, 429, 503)})
    def submit(spec: JobSpec, t: Caller, request: Request, response: Response, dry_run: Annotated[
            QueryBool, Query(description="check the spec and answer what would be stored "
                                         "(200); store nothing")] = False) -> dict[str, Any]:
        # FastAPI validates the body as a JobSpec, its one validation (a refusal is a 422
        # worded by errors.install); the service takes the typed spec as it is.
        if dry_run:
            response.status_code = 200
            return svc.dry_run(t, spec, body_bytes=body_bytes(request))
        return svc.submit(t, spec, body_bytes=body_bytes(request)).to_status()

    @app.get("/v1/jobs", tags=["jobs"], responses=errors.responses(401, 422, 503))
    def list_jobs(t: Caller, state: JobState | None = None,
                  limit: Annotated[int, Query(ge=1, le=LIST_LIMIT_MAX), DIGITS]
                  = LIST_LIMIT_DEFAULT) -> dict[str, Any]:
        jobs = svc.list(t, state=state.value if state else None, limit=limit)
        return {"jobs": [j.to_status() for j in jobs]}

    ends = app.state.job_ends = JobEnds(svc.redis)

    @app.get("/v1/jobs/{job_id}", tags=["jobs"], responses=errors.responses(401, 404, 422, 503))
    async def get_job(job_id: str, t: Caller, wait_s: Annotated[int, Query(
            ge=0, le=WAIT_MAX_S, description=(
                "a long poll: answer when the job is final or after this many seconds, "
                "whichever comes first (0: at once)")), DIGITS] = 0) -> dict[str, Any]:
        if wait_s:   # e31.api.waits: woken by the worker's announcement, else a store read
            async def is_final() -> bool:
                return await run_in_threadpool(svc.repo.job_state, t.id, job_id) in FINAL_STATES

            await ends.wait_until_final(job_id, is_final, wait_s)
        return (await run_in_threadpool(svc.get, t, job_id)).to_status()

    @app.post("/v1/jobs/{job_id}/cancel", tags=["jobs"],
              responses=errors.responses(401, 404, 503))
    def cancel(job_id: str, t: Caller) -> dict[str, Any]:
        return svc.cancel(t, job_id).to_status()

    @app.get("/v1/jobs/{job_id}/logs", tags=["jobs"], response_class=StreamingResponse,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                              "headers": LOG_HEADERS},
                        **errors.responses(401, 404, 422, 503)})
    def logs(job_id: str, t: Caller,
             attempt: Annotated[int | None, Query(ge=1, le=MAX_ATTEMPT), DIGITS] = None,
             offset: Annotated[int, Query(ge=0, le=MAX_LOG_OFFSET), DIGITS] = 0,
             limit: Annotated[int | None, Query(ge=1, le=MAX_LOG_OFFSET, description=(
                 "the most bytes to answer; never more than the server's "
                 "log_chunk_max_bytes")), DIGITS] = None) -> StreamingResponse:
        """One bounded chunk of the job's logs (one attempt's, or all under `=== attempt N ===`
        lines) from `offset`; ask again from X-E31-Next-Offset until it reaches X-E31-Log-Size."""
        chunk = svc.logs(t, job_id, attempt=attempt, offset=offset, limit=limit)
        return StreamingResponse(chunk.body, media_type="text/plain; charset=utf-8",
                                 headers={LOG_SIZE_HEADER: str(chunk.size_bytes),
                                          NEXT_OFFSET_HEADER: str(chunk.next_offset)})

    @app.get("/v1/jobs/{job_id}/outputs", tags=["jobs"],
             responses=errors.responses(401, 404, 503))
    def outputs(job_id: str, t: Caller) -> dict[str, Any]:
        return {"outputs": svc.outputs(t, job_id)}

    @app.get("/v1/jobs/{job_id}/outputs/{path:path}", tags=["jobs"],
             response_class=StreamingResponse, responses={
                 200: {"content": {"application/octet-stream": {
                     "schema": {"type": "string", "format": "binary"}}}},
                 **errors.responses(401, 404, 503)})
    def output_file(job_id: str, path: str, t: Caller) -> StreamingResponse:
        handle = svc.open_output(t, job_id, path)

        def chunks() -> Iterator[bytes]:
            with handle:
                while block := handle.read(CHUNK_BYTES):
                    yield block

        return StreamingResponse(chunks(), media_type="application/octet-stream")


def _add_array_routes(app: FastAPI, svc: Service) -> None:
    """`/v1/arrays`: submit N jobs as one; read, cancel and list the results of the whole."""

    @app.post("/v1/arrays", status_code=201, tags=["arrays"],
              responses=errors.responses(401, 403, 409, 413, 422, 429, 503))
    def submit_array(body: ArraySubmission, t: Caller, request: Request) -> dict[str, Any]:
        # The envelope is typed here; each item is validated once, by the service.
        status = svc.submit_many(t, body.items, name=body.name, defaults=body.defaults,
                                 body_bytes=body_bytes(request)).to_status()
        status["jobs"] = [item["id"] for item in status.pop("items")]
        return status

    @app.get("/v1/arrays/{array_id}", tags=["arrays"],
             responses=errors.responses(401, 404, 422, 503))
    def get_array(array_id: str, t: Caller,
                  items: Annotated[QueryBool, Query(description="list every item")] = True,
                  ) -> dict[str, Any]:
        return svc.get_array(t, array_id, items=items).to_status()

    @app.post("/v1/arrays/{array_id}/cancel", tags=["arrays"],
              responses=errors.responses(401, 404, 503))
    def cancel_array(array_id: str, t: Caller) -> dict[str, Any]:
        return svc.cancel_array(t, array_id).to_status()

    @app.post("/v1/arrays/{array_id}/retry", tags=["arrays"],
              responses=errors.responses(401, 404, 503))
    def retry_array(array_id: str, t: Caller) -> dict[str, Any]:
        """Queue the failed and cancelled items again, as their next attempt, and the jobs
        that their failure had cancelled (a merge after the array); `resubmitted` and
        `rearmed` name them."""
        return svc.retry_array(t, array_id).to_status()

    @app.get("/v1/arrays/{array_id}/manifest", tags=["arrays"],
             responses=errors.responses(401, 404, 503))
    def array_manifest(array_id: str, t: Caller) -> dict[str, Any]:
        return svc.array_manifest(t, array_id).to_dict()


def _add_pool_routes(app: FastAPI, svc: Service) -> None:
    """`/v1/queue` and `/v1/usage`: the shared pool as the caller may see it."""

    @app.get("/v1/queue", tags=["queue"], responses=errors.responses(401, 503))
    def queue(t: Caller) -> dict[str, Any]:
        """Per size class: GPUs, busy GPUs, queued jobs and running GPUs per tenant, each
        tenant's share of running GPUs against its share of weight (others merged unless admin)."""
        return svc.queue(t)

    @app.get("/v1/usage", tags=["usage"], responses=errors.responses(401, 403, 422, 503))
    def usage(t: Caller, all_tenants: Annotated[QueryBool, Query(
            description="every tenant's usage: an admin's token only (403 otherwise)")] = False,
              ) -> dict[str, Any]:
        return {"usage": svc.usage(t, all_tenants=all_tenants)}
