"""A Rich progress bar that follows a job until it ends (`e31 wait`, `job.wait(progress=True)`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

if TYPE_CHECKING:
    from e31.client.client import JobHandle


def follow(job: JobHandle, *, timeout: float | None = None,
           console: Console | None = None) -> dict[str, Any]:
    status: dict[str, Any] = {}
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[state]}"),
                  TimeElapsedColumn(), console=console or Console(stderr=True),
                  transient=False) as bar:
        task = bar.add_task(job.id, total=None, state="")
        for status in job.watch(timeout):
            prog = status.get("progress") or {}
            total = prog.get("total")
            bar.update(task, total=total or None, completed=prog.get("done") or 0,
                       state=status["state"],
                       description=f"{status.get('name') or job.id} ({job.id})")
        if status.get("state") == "succeeded":
            done = bar.tasks[0].total or 1
            bar.update(task, total=done, completed=done)
    return status
