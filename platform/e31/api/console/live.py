"""A job's log as it grows, as server-sent events, and its outputs' downloads: both through
the jobs service the CLI's `e31 logs` and `e31 outputs` reach (`JobService.logs`,
`JobService.open_output`), with the signed-in tenant."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from e31.api.console.render import Renderer
from e31.api.services.jobs import JobService
from e31.core.records import TenantRecord
from e31.core.states import FINAL_STATES

POLL_S = 1.0
STREAM_MAX_S = 300     # then the browser's EventSource reconnects, from Last-Event-ID
CHUNK_BYTES = 1 << 20


def router(view: Renderer) -> APIRouter:
    """`/ui/jobs/{id}/log` (text/event-stream) and `/ui/jobs/{id}/outputs/{path}`."""
    r = APIRouter(include_in_schema=False)

    @r.get("/ui/jobs/{job_id}/log")
    def log_events(request: Request, job_id: str) -> StreamingResponse:
        """Events `data: <JSON string of new log text>` with `id: <next offset>`, then an
        `end` event once the job is final and its log read to the end."""
        viewer = view.sessions.viewer(request)
        svc = view.services(request).jobs
        svc.get(viewer.tenant, job_id)   # 404 before the stream starts
        last = request.headers.get("last-event-id", "0")
        offset = int(last) if last.isdigit() else 0
        return StreamingResponse(_follow(request, svc, viewer.tenant, job_id, offset),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store"})

    @r.get("/ui/jobs/{job_id}/outputs/{path:path}")
    def output(request: Request, job_id: str, path: str) -> StreamingResponse:
        viewer = view.sessions.viewer(request)
        handle = view.services(request).jobs.open_output(viewer.tenant, job_id, path)

        def chunks() -> Iterator[bytes]:
            with handle:
                while block := handle.read(CHUNK_BYTES):
                    yield block

        name = path.rsplit("/", 1)[-1].replace('"', "")
        return StreamingResponse(chunks(), media_type="application/octet-stream",
                                 headers={"Content-Disposition": f'attachment; filename="{name}"'})

    return r


async def _follow(request: Request, svc: JobService, tenant: TenantRecord, job_id: str,
                  offset: int) -> AsyncIterator[bytes]:
    """Read the log from `offset` every `POLL_S` until the job is final and read whole."""
    deadline = time.monotonic() + STREAM_MAX_S
    yield b"retry: 2000\n\n"
    while time.monotonic() < deadline and not await request.is_disconnected():
        chunk = await run_in_threadpool(svc.logs, tenant, job_id, attempt=None, offset=offset)
        body = await run_in_threadpool(b"".join, chunk.body)
        if body:
            offset = chunk.next_offset
            text = json.dumps(body.decode("utf-8", errors="replace"))
            yield f"id: {offset}\ndata: {text}\n\n".encode()
            continue
        state = (await run_in_threadpool(svc.get, tenant, job_id)).state
        if state in FINAL_STATES:
            yield b"event: end\ndata: {}\n\n"
            return
        await asyncio.sleep(POLL_S)
