"""`/v1/jobs`: submit (or a dry run), list, read (with a long poll), cancel, logs and outputs of
one tenant's jobs (`e31.api.services.jobs`).

FastAPI validates a submitted body as a `JobSpec`, its one validation (a refusal is a 422 worded
by `e31.api.errors`); the service takes the typed spec as it is. Query numbers are digits only
(`e31.api.requestlimits.DIGITS`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse

from e31.api import errors
from e31.api.auth import Caller
from e31.api.requestlimits import DIGITS, QueryBool, body_bytes
from e31.api.services.jobs import LIST_LIMIT_MAX, JobService
from e31.api.waits import WAIT_MAX_S
from e31.core.spec import JobSpec
from e31.core.states import JobState

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


def router(svc: JobService) -> APIRouter:
    """The routes of `/v1/jobs`, in the order the document lists them."""
    r = APIRouter()
    _job_routes(r, svc)
    _file_routes(r, svc)
    return r


def _job_routes(r: APIRouter, svc: JobService) -> None:
    """Submit, list, read and cancel."""

    @r.post("/v1/jobs", status_code=201, tags=["jobs"], responses={
        200: {"description": "a dry run: what would be stored"},
        **errors.responses(401, 403, 409, 413, 422, 429, 503)})
    def submit(spec: JobSpec, t: Caller, request: Request, response: Response, dry_run: Annotated[
            QueryBool, Query(description="check the spec and answer what would be stored "
                                         "(200); store nothing")] = False) -> dict[str, Any]:
        if dry_run:
            response.status_code = 200
            return svc.dry_run(t, spec, body_bytes=body_bytes(request))
        return svc.submit(t, spec, body_bytes=body_bytes(request)).to_status()

    @r.get("/v1/jobs", tags=["jobs"], responses=errors.responses(401, 422, 503))
    def list_jobs(t: Caller, state: JobState | None = None,
                  limit: Annotated[int, Query(ge=1, le=LIST_LIMIT_MAX), DIGITS]
                  = LIST_LIMIT_DEFAULT,
                  name: Annotated[str | None, Query(
                      max_length=200, description="jobs whose name contains this")] = None,
                  size_class: Annotated[str | None, Query(max_length=32)] = None,
                  array: Annotated[str | None, Query(max_length=40)] = None,
                  before: Annotated[str | None, Query(max_length=40, description=(
                      "a job id: the jobs listed after it (the next page)"))] = None,
                  all_tenants: Annotated[QueryBool, Query(description=(
                      "every tenant's jobs: an admin's token only (403 otherwise)"))] = False,
                  ) -> dict[str, Any]:
        """The caller's jobs (an admin: every tenant's, with all_tenants), newest first."""
        jobs = svc.list(t, state=state.value if state else None, limit=limit, name=name,
                        size_class=size_class, array_id=array, before=before,
                        all_tenants=all_tenants)
        return {"jobs": [j.to_status() for j in jobs]}

    @r.get("/v1/jobs/{job_id}", tags=["jobs"], responses=errors.responses(401, 404, 422, 503))
    async def get_job(job_id: str, t: Caller, wait_s: Annotated[int, Query(
            ge=0, le=WAIT_MAX_S, description=(
                "a long poll: answer when the job is final or after this many seconds, "
                "whichever comes first (0: at once)")), DIGITS] = 0) -> dict[str, Any]:
        return (await svc.poll(t, job_id, wait_s=wait_s)).to_status()

    @r.post("/v1/jobs/{job_id}/cancel", tags=["jobs"],
            responses=errors.responses(401, 404, 503))
    def cancel(job_id: str, t: Caller) -> dict[str, Any]:
        return svc.cancel(t, job_id).to_status()


def _file_routes(r: APIRouter, svc: JobService) -> None:
    """Logs and outputs."""

    @r.get("/v1/jobs/{job_id}/logs", tags=["jobs"], response_class=StreamingResponse,
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

    @r.get("/v1/jobs/{job_id}/gpu", tags=["jobs"], responses=errors.responses(401, 404, 503))
    def gpu_series(job_id: str, t: Caller) -> dict[str, Any]:
        """The job's GPUs over its run: per point its time, node, mean utilisation (%) and
        memory used and total, a point every `step_s`, the newest `max_points` kept."""
        return svc.gpu_series(t, job_id)

    @r.get("/v1/jobs/{job_id}/outputs", tags=["jobs"],
           responses=errors.responses(401, 404, 503))
    def outputs(job_id: str, t: Caller) -> dict[str, Any]:
        return {"outputs": svc.outputs(t, job_id)}

    @r.get("/v1/jobs/{job_id}/outputs/{path:path}", tags=["jobs"],
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
