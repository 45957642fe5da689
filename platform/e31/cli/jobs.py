"""`e31` job commands: status, ls, logs, result, cancel, wait.

Each is a client of the HTTP API (`e31.client`, through `e31.cli.common`); an id that starts
with "a-" names an array, and status, result, cancel and wait then act on every item.
`e31 submit` is `e31.cli.submit`'s; `e31 queue` and `e31 usage`, `e31.cli.queue`'s.
Owns: the verbs on a submitted job or array and how they print. May import: `e31.cli.common`,
`e31.cli.common`, the `e31` core and `e31.client` (lazily, inside the commands, so that
`e31 --help` stays fast).
"""

from __future__ import annotations

import codecs
import json
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from e31.cli.common import (
    EXIT_FAILED,
    EXIT_INPUT,
    EXIT_INTERRUPTED,
    JsonOpt,
    api_client,
    call,
    counts,
    err,
    fail,
    is_array,
    out,
    print_json,
    wait_array,
    wait_job,
)
from e31.core.errors import JobFailed
from e31.core.states import JobState

ITEMS_SHOWN = 50           # items `e31 status a-…` lists in a table (--json lists all)
LS_NAME_MIN = 8     # `e31 ls`: a name narrower than this is dropped to its first characters

app = typer.Typer()


@app.command()
def status(job_id: str, as_json: bool = JsonOpt) -> None:
    """A job's state, attempts, result and usage; an array's counts and items."""
    if is_array(job_id):
        _array_status(job_id, as_json=as_json)
        return
    st = call(lambda: api_client().get(job_id).status())
    if as_json:
        print_json(st)
        return
    table = Table(show_header=False, box=None)
    for key in ("id", "name", "state", "idle_since", "reason", "error", "size_class", "queue",
                "priority", "submitted_at", "started_at", "ended_at", "queued_seconds",
                "gpu_seconds"):
        if st.get(key) not in (None, ""):
            table.add_row(f"[bold]{key}[/bold]", str(st[key]))
    isolation = st["attempts"][-1].get("isolation") if st["attempts"] else None
    if isolation:   # how its last attempt was kept apart (docs/security.md); --json: each one's
        table.add_row("[bold]isolation[/bold]", isolation)
    if st.get("progress"):
        progress = st["progress"]
        table.add_row("[bold]progress[/bold]", f"{progress['done']:g} / {progress['total'] or '?'}")
    if st.get("result") is not None:
        table.add_row("[bold]result[/bold]", json.dumps(st["result"]))
    if st.get("after"):
        table.add_row("[bold]after[/bold]", ", ".join(st["after"]))
    pending = st.get("pending")
    if pending:
        table.add_row("[bold]pending[/bold]", f"{pending['text']} ({pending['reason']})")
        if pending.get("position") is not None:
            table.add_row("[bold]position[/bold]",
                          f"{pending['position']} jobs before it in {st['queue']}")
        table.add_row("[bold]estimated start[/bold]", pending.get("estimated_start") or
                      f"none: {pending.get('no_estimate') or 'no recent starts in its queue'}")
    out.print(table)
    if st["attempts"]:
        at = Table("attempt", "worker", "gpus", "started", "setup", "ended", "reason",
                   "GPU mem", "GPU util", "limits", "error")
        for a in st["attempts"]:
            setup = f"{a['setup_s']:.1f} s" if a.get("setup_s") is not None else "-"
            at.add_row(str(a["n"]), a["worker"], a["gpus"] or "-", a["started_at"] or "", setup,
                       a["ended_at"] or "", _reason(a), *_gpu_use(a), _limits(a),
                       a["error"] or "")   # whole: a terminal wraps the cell, a pipe is wide
        out.print(at)


def _reason(attempt: dict[str, Any]) -> str:
    """An attempt's reason cell: why it ended ("oom: moved to gpu48" when it sent its job on
    to a bigger class), or how it runs."""
    if not attempt["reason"]:
        return _running(attempt)
    moved = attempt.get("moved_to")
    return f"{attempt['reason']}: moved to {moved}" if moved else str(attempt["reason"])


def _running(attempt: dict[str, Any]) -> str:
    """A running attempt's reason cell: "running", or "running (idle)" once its watchdog
    flagged it (since when: the job's idle_since)."""
    return "running (idle)" if attempt.get("idle_since") else "running"


def _limits(attempt: dict[str, Any]) -> str:
    """The limits the attempt ran under (docs/jobs.md, "Limits"): "pids 4096, mem 12 GB,
    disk 50 GB"; a limit not applied shows "none", an attempt older than them "-"."""
    limits = attempt.get("limits")
    if not limits:
        return "-"
    pids, mem, disk = limits.get("pids_max"), limits.get("mem_gb"), limits.get("disk_gb")
    parts = [f"pids {pids if pids is not None else 'none'}",
             f"mem {f'{mem:g} GB' if mem is not None else 'none'}",
             f"disk {f'{disk:g} GB' if disk is not None else 'none'}"]
    if limits.get("network"):
        parts.append(f"net {limits['network']}")
    return ", ".join(parts)


def _gpu_use(attempt: dict[str, Any]) -> tuple[str, str]:
    """What the attempt used of its GPUs: peak memory of one GPU, mean utilisation."""
    peak, util = attempt.get("gpu_mem_peak_gb"), attempt.get("gpu_util_mean")
    return (f"{peak:.1f} GB" if peak is not None else "-",
            f"{util:.0f} %" if util is not None else "-")


@app.command("ls")
def list_jobs(state: str | None = typer.Option(
                  None, "--state", help="only jobs in this state: queued, running, succeeded, "
                                        "failed or cancelled"),
              limit: int = typer.Option(50, "--limit", help="at most this many jobs"),
              wide: bool = typer.Option(False, "--wide",
                                        help="more columns (GPUs, priority, reason), none cut"),
              as_json: bool = JsonOpt) -> None:
    """Your jobs, newest first. Ids are never cut: the other columns give way."""
    jobs = call(api_client().list, state=state, limit=limit)
    if as_json:
        print_json(jobs)
        return
    _print_fitted(_job_rows(jobs, wide=wide), shrink=None if wide else ("name", "submitted"))



def _job_rows(jobs: list[dict[str, Any]], *, wide: bool) -> list[dict[str, str]]:
    rows = []
    for j in jobs:
        row = {"id": j["id"], "name": j["name"], "state": j["state"], "class": j["size_class"],
               "submitted": j["submitted_at"][:19].replace("T", " "),
               "gpu_s": f"{j['gpu_seconds']:.1f}"}
        if wide:
            row.update(gpus=str(j["gpus"]), priority=str(j["priority"]), reason=j["reason"] or "")
        rows.append(row)
    return rows


def _print_fitted(rows: list[dict[str, str]], *, shrink: tuple[str, str] | None) -> None:
    """Print `rows` as a table whose cells are never cut but the name's: in a narrow terminal
    the name gives way first (down to LS_NAME_MIN, with …), then the submitted column goes;
    what still does not fit runs past the edge rather than cutting an id. `shrink` None: every
    column at its full width, however wide (`--wide`)."""
    if not rows:
        out.print("no jobs")
        return
    gap = 2
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in rows[0]}
    total = sum(widths.values()) + gap * (len(widths) - 1)
    if shrink is not None and total > out.width:
        name, dropped = shrink
        cut = min(total - out.width, max(0, widths[name] - LS_NAME_MIN))
        widths[name] -= cut
        total -= cut
        if total > out.width:
            total -= widths.pop(dropped) + gap
    table = Table(box=None, pad_edge=False, padding=(0, gap // 2), show_edge=False)
    for column, width in widths.items():
        table.add_column(column, width=width, no_wrap=True, overflow="ellipsis",
                         header_style="bold")
    for r in rows:
        table.add_row(*(r[c] for c in widths))
    console = out if total <= out.width else Console(width=total, highlight=False)
    console.print(table, highlight=False)


@app.command()
def logs(job_id: str,
         follow: bool = typer.Option(False, "--follow", "-f",
                                     help="keep printing as the log grows, attempt after "
                                          "attempt, until the job ends"),
         attempt: int | None = typer.Option(None, "--attempt", help="one attempt only (1, 2, …)"),
         as_json: bool = JsonOpt) -> None:
    """A job's log: every attempt's, each under `=== attempt N ===`, or one attempt's."""
    job = call(api_client().get, job_id)
    st = call(job.status)
    count = len(st["attempts"])
    if attempt is not None and not (1 <= attempt <= count) \
            and not (follow and attempt > count and not JobState(st["state"]).is_final):
        fail(f"job {job_id} has {count} attempt{'' if count == 1 else 's'}"
             + (f"; --attempt takes 1 to {count}" if count else " yet"), EXIT_INPUT)
    if as_json:
        numbers = [attempt] if attempt else [a["n"] for a in st["attempts"]]
        print_json({"id": job_id, "logs": {str(n): call(job.logs, attempt=n) for n in numbers}})
        return
    if st.get("artifacts_removed_at"):
        _say_removed(job_id, st)
        return
    decoder = _decoder()
    chunks = iter(call(job.follow_logs, attempt) if follow
                  else call(job.log_chunks, attempt=attempt))
    try:
        while (chunk := call(next, chunks, None)) is not None:
            sys.stdout.write(decoder.decode(chunk))
            sys.stdout.flush()
    except KeyboardInterrupt:
        raise typer.Exit(EXIT_INTERRUPTED) from None
    sys.stdout.write(decoder.decode(b"", final=True))


def _say_removed(job_id: str, st: dict[str, Any]) -> None:
    """On stderr: the job's logs are gone, removed by `e31 gc` at the time its status says, so
    an empty answer is not read as a job that printed nothing (issue 32, rough edge 8)."""
    ended = f"it ended at {st['ended_at']}; " if st.get("ended_at") else ""
    err.print(f"the logs of {job_id} were removed by e31 gc at {st['artifacts_removed_at']} "
              f"({ended}logs and outputs are kept artifact_retention_days after the end); its "
              "status and result stay", highlight=False, markup=False, soft_wrap=True)


def _decoder() -> codecs.IncrementalDecoder:
    """UTF-8 text from log bytes that arrive in chunks: a character cut between two chunks
    is printed whole, with the second."""
    return codecs.getincrementaldecoder("utf-8")(errors="replace")


@app.command()
def result(job_id: str,
           download: Path | None = typer.Option(None, "--download",
                                                help="fetch outputs into DIR"),
           as_json: bool = JsonOpt) -> None:
    """A finished job's result (and its output files with --download); an array's manifest."""
    if is_array(job_id):
        _array_result(job_id, download=download, as_json=as_json)
        return
    job = call(api_client().get, job_id)
    state = call(job.status)["state"]
    if not JobState(state).is_final:    # nothing to fetch yet: the caller asked too early
        fail(f"job {job_id} is {state}: no result yet (e31 wait {job_id} waits for it)",
             EXIT_INPUT)
    try:
        value = call(job.result)
    except JobFailed as exc:
        if as_json:     # a script reads why: the status, with its reason and error
            print_json(exc.status)
        fail(exc.message, EXIT_FAILED)
    files = call(job.download, download) if download else []
    if as_json:
        print_json({"result": value, "downloaded": [str(p) for p in files]})
        return
    out.print_json(json.dumps(value))
    for p in files:
        err.print(f"downloaded {p}")


@app.command()
def cancel(job_id: str, as_json: bool = JsonOpt) -> None:
    """Cancel a job: a queued one never runs, a running one is killed within seconds.
    An array id cancels every item."""
    if is_array(job_id):
        _array_cancel(job_id, as_json=as_json)
        return
    st = call(lambda: api_client().get(job_id).cancel())
    if as_json:
        print_json(st)
    elif st["state"] in ("succeeded", "failed"):
        out.print(f"{job_id} already {st['state']}")
    else:
        out.print(f"{job_id} {'cancelled' if st['state'] == 'cancelled' else 'cancelling'}")


@app.command("wait")
def wait_cmd(job_id: str, timeout: float | None = typer.Option(
                 None, "--timeout", help="seconds; exit 4 if it has not ended by then"),
             as_json: bool = JsonOpt) -> None:
    """Wait for a job (or every item of an array) with a progress bar; exit 1 unless it
    (every item) succeeded, 4 if it is still running when --timeout passes."""
    if is_array(job_id):
        wait_array(call(api_client().get_array, job_id), as_json=as_json, timeout=timeout)
        return
    wait_job(call(api_client().get, job_id), as_json=as_json, timeout=timeout)


# -- arrays -----------------------------------------------------------------------------

def _array_status(array_id: str, *, as_json: bool) -> None:
    st = call(lambda: api_client().get_array(array_id).status())
    if as_json:
        print_json(st)
        return
    table = Table(show_header=False, box=None)
    for key in ("id", "name", "state", "submitted_at"):
        table.add_row(f"[bold]{key}[/bold]", str(st[key]))
    table.add_row("[bold]progress[/bold]", counts(st))
    out.print(table)
    items = Table("index", "job", "state", "reason")
    for item in st["items"][:ITEMS_SHOWN]:
        items.add_row(str(item["index"]), item["id"], item["state"], item["reason"] or "")
    out.print(items)
    if len(st["items"]) > ITEMS_SHOWN:
        out.print(f"… {len(st['items']) - ITEMS_SHOWN} more items (--json lists them all)")


def _array_cancel(array_id: str, *, as_json: bool) -> None:
    st = call(lambda: api_client().get_array(array_id).cancel())
    if as_json:
        print_json(st)
        return
    ended = st["succeeded"] + st["failed"]
    out.print(f"{array_id}: {st['cancelled']} cancelled, {st['running']} cancelling, "
              f"{ended} already ended", highlight=False)


def _array_result(array_id: str, *, download: Path | None, as_json: bool) -> None:
    from e31.client import JobHandle
    client = api_client()
    manifest = call(lambda: client.get_array(array_id).manifest())
    files: list[Path] = []
    for item in manifest["items"] if download else []:
        if item["outputs"]:
            job = JobHandle(client, item["id"])
            files += call(job.download, Path(download or ".") / str(item["index"]))
    if as_json:
        print_json({**manifest, "downloaded": [str(p) for p in files]})
    else:
        out.print_json(json.dumps(manifest))
        for p in files:
            err.print(f"downloaded {p}")
    live = manifest["total"] - manifest["done"]
    if live:
        err.print(f"{live} of {manifest['total']} items not finished yet (e31 wait {array_id})")
    if manifest["failed"] or manifest["cancelled"]:
        fail(f"array {array_id}: {manifest['failed']} failed, {manifest['cancelled']} cancelled "
             f"of {manifest['total']}", EXIT_FAILED)
