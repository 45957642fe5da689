"""The console's views: jobs, a job, an array, the queue, usage and the GPUs. Each calls the
service its JSON route calls (`/v1/jobs`, `/v1/jobs/{id}`, `/v1/arrays/{id}`, `/v1/queue`,
`/v1/usage`, `/v1/top`) with the signed-in tenant, and renders what that answers."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from starlette.concurrency import run_in_threadpool

from e31.api.console import charts
from e31.api.console.render import Renderer
from e31.api.services.usage import DAYS_MAX
from e31.core.states import JobState

PAGE_SIZE = 50
PENDING_SHOWN = 20   # queued rows of a page that show why they wait (each its position read)
ARRAY_GRID_MAX = 10_000
_Text = Annotated[str | None, Query(max_length=200)]


def router(view: Renderer) -> APIRouter:
    """The GET pages of `/ui`: jobs, a job and an array here, the pool's in `_pool_views`."""
    r = APIRouter(include_in_schema=False)

    @r.get("/ui")
    @r.get("/ui/")
    def home() -> RedirectResponse:
        return RedirectResponse("/ui/jobs", status_code=303)

    @r.get("/ui/jobs", response_class=HTMLResponse)
    def jobs(request: Request, state: JobState | None = None, name: _Text = None,
             size_class: _Text = None, array: _Text = None,
             before: _Text = None) -> HTMLResponse:
        viewer = view.sessions.viewer(request)
        svc = view.services(request).jobs
        every = viewer.tenant.admin   # an admin sees every tenant's, as ?all_tenants=true
        found = svc.list(viewer.tenant, state=state.value if state else None,
                         limit=PAGE_SIZE + 1, name=name or None,
                         size_class=size_class or None, array_id=array or None,
                         before=before or None, all_tenants=every)
        shown = found[:PAGE_SIZE]
        queued = [j for j in shown if j.state == JobState.QUEUED.value
                  and j.tenant == viewer.tenant.name][:PENDING_SHOWN]   # its own: its place
        why = svc.pending(viewer.tenant, queued) if queued else {}   # as each status says
        rows = [{**j.to_status(), "pending": why.get(j.id)} for j in shown]
        filters = {"state": state.value if state else "", "name": name or "",
                   "size_class": size_class or "", "array": array or ""}
        return view.page(request, "jobs.html", viewer, jobs=rows, filters=filters,
                         show_tenant=every,
                         states=[s.value for s in JobState], paged=bool(before),
                         next_before=rows[-1]["id"] if len(found) > PAGE_SIZE else None)

    @r.get("/ui/jobs/{job_id}", response_class=HTMLResponse)
    async def job(request: Request, job_id: str) -> HTMLResponse:
        viewer = view.sessions.viewer(request)
        svc = view.services(request).jobs
        record = await svc.poll(viewer.tenant, job_id, wait_s=0)
        status = record.to_status()
        outputs = await run_in_threadpool(svc.outputs, viewer.tenant, job_id)
        series = await run_in_threadpool(svc.gpu_series, viewer.tenant, job_id)
        return view.page(request, "job.html", viewer, job=status, spec=record.spec,
                         outputs=outputs, gpu=charts.gpu_lines(series["points"]),
                         final=status["state"] in {"succeeded", "failed", "cancelled"})

    @r.get("/ui/arrays/{array_id}", response_class=HTMLResponse)
    def array(request: Request, array_id: str) -> HTMLResponse:
        viewer = view.sessions.viewer(request)
        status = view.services(request).arrays.get(viewer.tenant, array_id).to_status()
        return view.page(request, "array.html", viewer, array=status,
                         items=status.get("items", [])[:ARRAY_GRID_MAX],
                         states=[s.value for s in JobState])

    _pool_views(r, view)
    return r


def _pool_views(r: APIRouter, view: Renderer) -> None:
    """The queue, usage and GPU pages."""

    @r.get("/ui/queue", response_class=HTMLResponse)
    def queue(request: Request) -> HTMLResponse:
        viewer = view.sessions.viewer(request)
        overview = view.services(request).queue.overview(viewer.tenant)
        return view.page(request, "queue.html", viewer, queue=overview)

    @r.get("/ui/usage", response_class=HTMLResponse)
    def usage(request: Request, days: Annotated[int, Query(ge=1, le=DAYS_MAX)] = 7,
              ) -> HTMLResponse:
        viewer = view.sessions.viewer(request)
        svc = view.services(request).usage
        every = viewer.tenant.admin   # an admin sees every tenant's, as `e31 usage --all`
        rows = svc.usage(viewer.tenant, all_tenants=every)
        # GPU-seconds; run seconds where no GPU was used (a pool of cpu slots)
        metric = "gpu_seconds" if any(u["gpu_seconds"] for u in rows) else "run_seconds"
        bars = charts.bars([(f"{u['tenant']} · {u['size_class']}", u[metric]) for u in rows])
        daily = svc.by_day(viewer.tenant, all_tenants=every, days=days)
        return view.page(request, "usage.html", viewer, usage=rows, chart=bars,
                         unit="GPU-s" if metric == "gpu_seconds" else "s run",
                         batches=svc.batches(viewer.tenant, all_tenants=every),
                         days=days, daily=daily, daily_chart=_per_day(daily))

    @r.get("/ui/gpus", response_class=HTMLResponse)
    def gpus(request: Request) -> HTMLResponse:
        viewer = view.sessions.viewer(request)
        top: dict[str, Any] = view.services(request).top.top(viewer.tenant)
        return view.page(request, "gpus.html", viewer, top=top)


def _per_day(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The daily rows summed per day, as bars in day order: GPU-hours, or the jobs that
    ended where no GPU was used."""
    gpu: dict[str, float] = {}
    jobs: dict[str, float] = {}
    for row in rows:
        gpu[row["day"]] = gpu.get(row["day"], 0.0) + row["gpu_seconds"] / 3600
        jobs[row["day"]] = jobs.get(row["day"], 0.0) + row["jobs"]
    chosen, unit = (gpu, "GPU-h") if any(gpu.values()) else (jobs, "jobs")
    return {**charts.bars(sorted(chosen.items()), longest_first=False), "unit": unit}
