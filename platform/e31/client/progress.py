"""Rich progress bars on stderr that follow a job, or a whole array, until it ends
(`e31 wait`, `job.wait(progress=True)`, `array.wait(progress=True)`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text

if TYPE_CHECKING:
    from e31.client.handles import ArrayHandle, JobHandle

ARRAY_COUNTS = ("running", "succeeded", "failed", "cancelled")   # shown beside the bar when > 0


class RateColumn(ProgressColumn):
    """How fast `done` grows, per second, with the job's unit: frames/s for a footage fan-out
    (its progress counts frames), /s otherwise."""

    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        unit = task.fields.get("unit", "")
        return Text(f"{speed:,.1f} {unit}/s".replace(" /s", "/s") if speed else "")


def progress_unit(status: dict[str, Any]) -> str:
    """The unit a job's progress counts: frames for a footage fan-out's merge job (it waits
    on the array whose chunks count frames), none otherwise."""
    return "frames" if any(str(a).startswith("a-") for a in status.get("after") or []) \
        and (status.get("progress") or {}).get("total") else ""


def follow(job: JobHandle, *, timeout: float | None = None,
           console: Console | None = None) -> dict[str, Any]:
    """A bar of one job: the progress it reports (`done` of `total`) and its state; returns
    the last status, which is final unless `timeout` ran out (`JobTimeout`). While it is
    queued, why it waits is said as a line of its own at the first status and each time the
    reason changes (`waiting_line`): off a terminal the bar draws nothing, and a job of a class
    nobody serves would otherwise wait in silence (issue 32)."""
    status: dict[str, Any] = {}
    said: str | None = None
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[state]}"),
                  RateColumn(), TimeElapsedColumn(), console=console or Console(stderr=True),
                  transient=False) as bar:
        task = bar.add_task(job.id, total=None, state="", unit="")
        for status in job.watch(timeout):
            line = waiting_line(job.id, status)
            if line is not None and line != said:
                bar.console.print(line, highlight=False, markup=False, soft_wrap=True)
            said = line
            prog = status.get("progress") or {}
            total = prog.get("total")
            bar.update(task, total=total or None, completed=prog.get("done") or 0,
                       state=status["state"], unit=progress_unit(status),
                       description=f"{status.get('name') or job.id} ({job.id})")
        if status.get("state") == "succeeded":
            done = bar.tasks[0].total or 1
            bar.update(task, total=done, completed=done)
    return status


def waiting_line(job_id: str, status: dict[str, Any]) -> str | None:
    """`j-… waits: <why>` of a queued job, from its status's `pending` text (what `e31 status`
    says); None once it no longer waits or when the status gives no reason."""
    pending = status.get("pending") if status.get("state") == "queued" else None
    text = (pending or {}).get("text")
    return f"{job_id} waits: {text}" if text else None


def follow_array(array: ArrayHandle, *, timeout: float | None = None,
                 console: Console | None = None) -> None:
    """A bar of the whole array: items done of the total, with the running and ended counts."""
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[counts]}"), TimeElapsedColumn(),
                  console=console or Console(stderr=True)) as bar:
        task = bar.add_task(array.id, total=None, counts="")
        for st in array.watch(timeout):
            counts = ", ".join(f"{st[k]} {k}" for k in ARRAY_COUNTS if st.get(k))
            bar.update(task, total=st["total"], completed=st["done"], counts=counts,
                       description=f"{st.get('name') or array.id} ({array.id})")
