"""`e31` job commands: submit, status, ls, logs, result, cancel, wait, usage, queue.

Each is a client of the HTTP API (`e31.client`, built from the profile or E31_API_URL); an id
that starts with "a-" names an array, and status, result, cancel and wait then act on every item.
Owns: the job and array verbs and how they print. May import: `e31.cli.common`, the `e31` core
and `e31.client` (lazily, inside the commands, so that `e31 --help` stays fast).
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.table import Table

from e31.cli.common import (
    EXIT_FAILED,
    EXIT_INPUT,
    EXIT_INTERRUPTED,
    EXIT_TIMEOUT,
    EXIT_UNAVAILABLE,
    JsonOpt,
    err,
    fail,
    out,
    print_json,
)
from e31.core.errors import ClientError, JobFailed, JobTimeout, SpecError
from e31.core.states import JobState

if TYPE_CHECKING:
    from e31.ops.sweep import Sweep

ARRAY_PREFIX = "a-"        # array ids; job ids start with "j-"
ITEMS_SHOWN = 50           # items `e31 status a-…` lists in a table (--json lists all)

app = typer.Typer()


def _client() -> Any:
    from e31.client import Client
    try:
        return Client()
    except ClientError as exc:
        fail(exc.message, EXIT_UNAVAILABLE)


def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run a client call, turning its errors into a one-line message and an exit code."""
    try:
        return fn(*args, **kwargs)
    except JobFailed:
        raise
    except JobTimeout as exc:    # still running: neither failed nor unavailable
        fail(exc.message, EXIT_TIMEOUT)
    except ClientError as exc:
        code = EXIT_INPUT if exc.status_code in (400, 403, 404, 409, 413, 422) else EXIT_UNAVAILABLE
        fail(exc.message, code)
    except SpecError as exc:     # found before a request was sent: a workdir or input path
        fail(exc.message, EXIT_INPUT)


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _pairs(items: list[str], flag: str) -> dict[str, Any]:
    result = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            fail(f"{flag} {item!r}: expected KEY=VALUE", EXIT_INPUT)
        result[key] = value if flag == "--env" else _parse_value(value)
    return result


def _read_spec(spec_file: Path | None,
               sweep_file: Path | None) -> tuple[dict[str, Any], Sweep | None, Path | None]:
    """The spec file's body, the sweep (of --sweep, or the spec file itself when it is one) and
    the file that sweep came from; with a sweep, the body is the spec file over its base."""
    from e31.client.bundle import resolve_paths
    from e31.core.spec import load_spec_file
    from e31.ops.sweep import is_sweep, load_sweep_file, merge_item, parse_sweep
    sweep: Sweep | None = None
    try:
        body: dict[str, Any] = {}
        if spec_file:   # its workdir and local inputs are relative to the file
            body = resolve_paths(load_spec_file(spec_file), spec_file.parent)
        if sweep_file is not None:
            sweep = load_sweep_file(sweep_file)
            sweep = dataclasses.replace(sweep, base=resolve_paths(sweep.base, sweep_file.parent))
        if is_sweep(body):            # a sweep file given as the spec file
            if sweep is not None:
                fail("give one sweep file, not two", EXIT_INPUT)
            sweep, sweep_file, body = parse_sweep(body), spec_file, {}
        if sweep is not None:
            body = merge_item(sweep.base, body)   # flags > spec file > the sweep's base
    except SpecError as exc:
        fail(exc.message, EXIT_INPUT)
    return body, sweep, sweep_file


def _set_given(body: dict[str, Any], section: str | None, **flags: Any) -> None:
    """Set the flags that were given (not None) over the spec, in `body[section]` or, without
    a section, in `body` itself."""
    given = {key: value for key, value in flags.items() if value is not None}
    if section is None:
        body.update(given)
        return
    merged = {**(body.get(section) or {}), **given}
    if merged:
        body[section] = merged


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": False})
def submit(
    spec_file: Path | None = typer.Argument(None, help="a job spec in YAML or JSON"),
    entrypoint: str | None = typer.Option(None, "--entrypoint", "-e", help="module:function"),
    workload: str | None = typer.Option(
        None, "--workload", "-w", help="a built-in workload: batch-inference, train, footage "
                                       "(the job is named after it unless --name)"),
    param: list[str] = typer.Option([], "--param", "-p",
                                    help="KEY=VALUE (VALUE parsed as JSON if it can be)"),
    env: list[str] = typer.Option([], "--env", help="KEY=VALUE for the job's environment"),
    gpus: int | None = typer.Option(None, "--gpus", help="GPUs (0: the cpu class)"),
    gpu_mem_gb: float | None = typer.Option(None, "--gpu-mem", help="GB of GPU memory needed"),
    size_class: str | None = typer.Option(None, "--size-class", help="e.g. gpu80"),
    mem_gb: float | None = typer.Option(
        None, "--mem-gb", help="GB of host memory the job may use (past it: reason oom)"),
    disk_gb: float | None = typer.Option(
        None, "--disk-gb", help="GB its scratch, outputs and checkpoints may fill (past it: "
                                "reason disk_quota); default: the pool's attempt_disk_gb"),
    on_oom: str | None = typer.Option(
        None, "--on-oom", help="after an attempt that ran out of memory: next_class (queue it "
                               "in the next bigger size class) or fail (retry it in its own); "
                               "default: the pool's on_oom_default"),
    allow_pending: bool = typer.Option(
        False, "--allow-pending", help="store the job even when no registered node has the "
                                       "GPUs it asks for (refused otherwise); it waits until "
                                       "such a node joins"),
    preemptible: bool | None = typer.Option(
        None, "--preemptible/--not-preemptible",
        help="whether the scheduler may stop the job (it gets SIGTERM and its grace to "
             "checkpoint) for a job of a higher band or a tenant below its share, and requeue "
             "it to resume from its checkpoint; default: only the training workload"),
    timeout_s: float | None = typer.Option(None, "--timeout", help="seconds per attempt"),
    retries: int | None = typer.Option(None, "--retries", help="retries after a failed attempt"),
    backoff_s: float | None = typer.Option(None, "--backoff", help="first retry delay, seconds"),
    backoff_max_s: float | None = typer.Option(
        None, "--backoff-max", help="longest retry delay, seconds (the delay doubles up to it)"),
    max_lost: int | None = typer.Option(
        None, "--max-lost", help="attempts lost with their worker before the job fails as a "
                                 "poison job"),
    priority: int | None = typer.Option(None, "--priority", help="0..9, higher first"),
    name: str | None = typer.Option(None, "--name", help="a name for people (default: the "
                                                          "workload, function or command)"),
    after: list[str] = typer.Option(
        [], "--after", help="a job id (j-…) or array id (a-…) that must succeed first "
                            "(repeatable)"),
    pip: list[str] = typer.Option([], "--pip", help="a pip requirement to install for the "
                                                     "job, e.g. 'tqdm==4.66' (repeatable)"),
    requirements: str | None = typer.Option(
        None, "--requirements", help="a requirements file in the job's code (--workdir), "
                                     "relative to it"),
    inputs: list[str] = typer.Option(
        [], "--input", help="NAME=SOURCE staged into $E31_INPUT_DIR/NAME: a local path, "
                            "file://, s3://, http(s):// or bundle:… (repeatable)"),
    network: str | None = typer.Option(
        None, "--network", help="none: the job gets no network at all (sandboxed workers)"),
    secrets: list[str] = typer.Option(
        [], "--secret", help="a secret of your tenant (e31 secret set NAME) given to the job "
                             "as the variable NAME (repeatable)"),
    idle_timeout_s: int | None = typer.Option(
        None, "--idle-timeout", help="seconds without log output, progress or GPU use after "
                                     "which the job counts as idle"),
    on_idle: str | None = typer.Option(None, "--on-idle",
                                       help="flag (show it) or kill (stop it, reason idle)"),
    code: str | None = typer.Option(
        None, "--code", help="sha256:<hex> of a bundle already uploaded (instead of --workdir)"),
    sweep_file: Path | None = typer.Option(
        None, "--sweep", help="a sweep file (grid: or list: of params): one job per item, "
                              "submitted as one array over the spec file and flags"),
    wait: bool = typer.Option(False, "--wait", help="wait for the end, with a progress bar"),
    workdir: Path | None = typer.Option(
        None, "--workdir", help="send this directory as the job's code: the job starts in it, "
                                "with it first on PYTHONPATH (.gitignore and .e31ignore apply)"),
    dry_run: bool = typer.Option(False, "--dry-run",
                                 help="check the job and print what would be stored and "
                                      "uploaded; submit and upload nothing"),
    as_json: bool = JsonOpt,
) -> None:
    """Submit a job: a spec file, or flags, or `-- argv...` for a command job; with a sweep
    file (--sweep, or as the spec file), an array of jobs. Every spec field has a flag, and
    a flag wins over the spec file."""
    argv = sys.argv[sys.argv.index("--") + 1:] if "--" in sys.argv else []
    if argv and spec_file is not None and str(spec_file) == argv[0]:
        spec_file = None  # Click hands the first word after `--` to the positional argument
    body, sweep, sweep_file = _read_spec(spec_file, sweep_file)
    scalars = {"workdir": str(workdir) if workdir is not None else None,
               "command": argv or None, "entrypoint": entrypoint, "workload": workload}
    _set_given(body, None, **scalars)
    for key, given in (("params", _pairs(param, "--param")), ("env", _pairs(env, "--env")),
                       ("inputs", _pairs(inputs, "--input"))):
        if given:
            body[key] = {**body.get(key, {}), **given}
    for key, values in (("after", after), ("secrets", secrets)):
        if values:
            body[key] = [*body.get(key, []), *values]
    if pip:
        body["python"] = {**(body.get("python") or {}),
                          "pip": [*(body.get("python") or {}).get("pip", []), *pip]}
    _set_given(body, "python", requirements=requirements)
    _set_given(body, "resources", gpus=gpus, gpu_mem_gb=gpu_mem_gb, size_class=size_class,
               mem_gb=mem_gb, disk_gb=disk_gb, on_oom=on_oom)
    _set_given(body, "retries", max=retries, backoff_s=backoff_s, backoff_max_s=backoff_max_s,
               max_lost=max_lost)
    _set_given(body, None, timeout_s=timeout_s, priority=priority, name=name, network=network,
               idle_timeout_s=idle_timeout_s, on_idle=on_idle, code=code,
               allow_pending=allow_pending or None, preemptible=preemptible)
    # A sweep's --name (or name:) names the array; the spec's name, each job.
    array_name = None if sweep is None else body.pop("name", None) or Path(str(sweep_file)).stem
    if isinstance(body.get("workload"), str) and not body.get("name"):
        body["name"] = body["workload"]    # `-w train` is named train, not after its function
    _check_finite(body)
    client = _client()
    if dry_run:
        _dry_run(client, body, sweep, as_json=as_json)
    elif sweep is not None:
        _submit_array(client, body, sweep, str(array_name), wait=wait, as_json=as_json)
    else:
        job = _call(client.submit, body)
        _say_bundles(client)
        if wait:
            _wait(job, as_json=as_json, timeout=None)
        elif as_json:
            print_json(job.status())
        else:
            out.print(job.id)


def _submit_array(client: Any, body: dict[str, Any], sweep: Sweep, name: str, *, wait: bool,
                  as_json: bool) -> None:
    array = _call(client.submit_many, sweep.items(), name=name, **body)
    _say_bundles(client)
    if wait:
        _wait_array(array, as_json=as_json, timeout=None)
    elif as_json:
        print_json(_call(array.status))
    else:
        out.print(array.id)


def _check_finite(value: Any, where: str = "") -> None:
    """Exit 2 naming the first number JSON cannot carry (NaN, Infinity: YAML's `.nan`, `.inf`,
    or `-p a=NaN`), before anything is sent: the API would refuse it, but it cannot even be
    written as JSON to send."""
    if isinstance(value, float) and not math.isfinite(value):
        fail(f"{where or 'spec'}: {value} is not a number JSON can carry (no NaN or Infinity)",
             EXIT_INPUT)
    items = value.items() if isinstance(value, dict) else \
        enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        _check_finite(item, f"{where}[{key}]" if isinstance(key, int) else
                      f"{where}.{key}" if where else str(key))


def _say_bundles(client: Any) -> None:
    """On stderr: each bundle the submission sent, or found held by the API already."""
    for sent in client.last_bundles:
        what = (f"uploaded ({sent.files} file{'' if sent.files == 1 else 's'}, "
                f"{sent.size_bytes} bytes)") if sent.uploaded else "already held, nothing uploaded"
        err.print(f"{sent.field}: {sent.digest} {what}", highlight=False)


def _dry_run(client: Any, body: dict[str, Any], sweep: Sweep | None, *, as_json: bool) -> None:
    """Print what `submit` would store and upload for `body` (a sweep's first item)."""
    from e31.ops.sweep import merge_item
    if sweep is not None:
        body = merge_item(body, sweep.items()[0])
    answer = _call(client.dry_run, body)
    if as_json:
        print_json(answer)
        return
    table = Table(show_header=False, box=None)
    for key in ("name", "size_class", "queue", "gpus", "code"):
        if answer.get(key) is not None:
            table.add_row(f"[bold]{key}[/bold]", str(answer[key]))
    if answer.get("could_run_now"):
        where = answer["where"]
        table.add_row("[bold]could start[/bold]", f"now, on {where['worker']} ({where['host']})")
    elif answer.get("pending"):
        pending = answer["pending"]
        table.add_row("[bold]would wait[/bold]", f"{pending['text']} ({pending['reason']})")
        table.add_row("[bold]estimated start[/bold]", answer.get("estimated_start") or
                      f"none: {pending.get('no_estimate') or 'no recent starts in its queue'}")
    for up in answer["uploads"]:
        table.add_row("[bold]upload[/bold]", f"{up['field']}: {up['digest']} ({up['files']} "
                                               f"files, {up['size_bytes']} bytes)")
    out.print(table)
    out.print("dry run: nothing was submitted or uploaded")


@app.command()
def status(job_id: str, as_json: bool = JsonOpt) -> None:
    """A job's state, attempts, result and usage; an array's counts and items."""
    if _is_array(job_id):
        _array_status(job_id, as_json=as_json)
        return
    st = _call(lambda: _client().get(job_id).status())
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
                       (a["error"] or "")[:80])
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
    jobs = _call(_client().list, state=state, limit=limit)
    if as_json:
        print_json(jobs)
        return
    _print_fitted(_job_rows(jobs, wide=wide), shrink=None if wide else ("name", "submitted"))


LS_NAME_MIN = 8     # `e31 ls`: a name narrower than this is dropped to its first characters


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
    job = _call(_client().get, job_id)
    st = _call(job.status)
    count = len(st["attempts"])
    if attempt is not None and not (1 <= attempt <= count) \
            and not (follow and attempt > count and not JobState(st["state"]).is_final):
        fail(f"job {job_id} has {count} attempt{'' if count == 1 else 's'}"
             + (f"; --attempt takes 1 to {count}" if count else " yet"), EXIT_INPUT)
    if as_json:
        numbers = [attempt] if attempt else [a["n"] for a in st["attempts"]]
        print_json({"id": job_id, "logs": {str(n): _call(job.logs, attempt=n) for n in numbers}})
        return
    decoder = _decoder()
    chunks = iter(_call(job.follow_logs, attempt) if follow
                  else _call(job.log_chunks, attempt=attempt))
    try:
        while (chunk := _call(next, chunks, None)) is not None:
            sys.stdout.write(decoder.decode(chunk))
            sys.stdout.flush()
    except KeyboardInterrupt:
        raise typer.Exit(EXIT_INTERRUPTED) from None
    sys.stdout.write(decoder.decode(b"", final=True))


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
    if _is_array(job_id):
        _array_result(job_id, download=download, as_json=as_json)
        return
    job = _call(_client().get, job_id)
    state = _call(job.status)["state"]
    if not JobState(state).is_final:    # nothing to fetch yet: the caller asked too early
        fail(f"job {job_id} is {state}: no result yet (e31 wait {job_id} waits for it)",
             EXIT_INPUT)
    try:
        value = _call(job.result)
    except JobFailed as exc:
        if as_json:     # a script reads why: the status, with its reason and error
            print_json(exc.status)
        fail(exc.message, EXIT_FAILED)
    files = _call(job.download, download) if download else []
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
    if _is_array(job_id):
        _array_cancel(job_id, as_json=as_json)
        return
    st = _call(lambda: _client().get(job_id).cancel())
    if as_json:
        print_json(st)
    elif st["state"] in ("succeeded", "failed"):
        out.print(f"{job_id} already {st['state']}")
    else:
        out.print(f"{job_id} {'cancelled' if st['state'] == 'cancelled' else 'cancelling'}")


def _wait(job: Any, *, as_json: bool, timeout: float | None) -> None:
    try:
        st = _call(job.wait, timeout=timeout, progress=not as_json)
    except JobFailed as exc:
        if as_json:
            print_json(exc.status)
        fail(exc.message, EXIT_FAILED)
    if as_json:
        print_json(st)
    else:
        print(f"{job.id} succeeded: {json.dumps(st['result'])}")


@app.command("wait")
def wait_cmd(job_id: str, timeout: float | None = typer.Option(
                 None, "--timeout", help="seconds; exit 4 if it has not ended by then"),
             as_json: bool = JsonOpt) -> None:
    """Wait for a job (or every item of an array) with a progress bar; exit 1 unless it
    (every item) succeeded, 4 if it is still running when --timeout passes."""
    if _is_array(job_id):
        _wait_array(_call(_client().get_array, job_id), as_json=as_json, timeout=timeout)
        return
    _wait(_call(_client().get, job_id), as_json=as_json, timeout=timeout)


# -- arrays -----------------------------------------------------------------------------

def _is_array(some_id: str) -> bool:
    return some_id.startswith(ARRAY_PREFIX)


def _counts(st: dict[str, Any]) -> str:
    shown = [f"{st[k]} {k}" for k in ("succeeded", "failed", "cancelled", "running", "queued")
             if st.get(k)]
    return f"{st['done']}/{st['total']} done" + (f": {', '.join(shown)}" if shown else "")


def _wait_array(array: Any, *, as_json: bool, timeout: float | None) -> None:
    st = _call(array.wait, timeout=timeout, progress=not as_json)
    if as_json:
        print_json(st)
    else:
        out.print(f"{array.id} {st['state']}, {_counts(st)}", highlight=False)
    if st["state"] != "succeeded":
        bad = [i for i in st.get("items", []) if i["state"] != "succeeded"]
        listed = ", ".join(f"[{i['index']}] {i['id']} {i['reason'] or i['state']}" for i in bad[:5])
        fail(f"array {array.id}: {st['failed']} failed, {st['cancelled']} cancelled of "
             f"{st['total']}" + (f" ({listed}{', …' if len(bad) > 5 else ''})" if listed else ""),
             EXIT_FAILED)


def _array_status(array_id: str, *, as_json: bool) -> None:
    st = _call(lambda: _client().get_array(array_id).status())
    if as_json:
        print_json(st)
        return
    table = Table(show_header=False, box=None)
    for key in ("id", "name", "state", "submitted_at"):
        table.add_row(f"[bold]{key}[/bold]", str(st[key]))
    table.add_row("[bold]progress[/bold]", _counts(st))
    out.print(table)
    items = Table("index", "job", "state", "reason")
    for item in st["items"][:ITEMS_SHOWN]:
        items.add_row(str(item["index"]), item["id"], item["state"], item["reason"] or "")
    out.print(items)
    if len(st["items"]) > ITEMS_SHOWN:
        out.print(f"… {len(st['items']) - ITEMS_SHOWN} more items (--json lists them all)")


def _array_cancel(array_id: str, *, as_json: bool) -> None:
    st = _call(lambda: _client().get_array(array_id).cancel())
    if as_json:
        print_json(st)
        return
    ended = st["succeeded"] + st["failed"]
    out.print(f"{array_id}: {st['cancelled']} cancelled, {st['running']} cancelling, "
              f"{ended} already ended", highlight=False)


def _array_result(array_id: str, *, download: Path | None, as_json: bool) -> None:
    from e31.client import JobHandle
    client = _client()
    manifest = _call(lambda: client.get_array(array_id).manifest())
    files: list[Path] = []
    for item in manifest["items"] if download else []:
        if item["outputs"]:
            job = JobHandle(client, item["id"])
            files += _call(job.download, Path(download or ".") / str(item["index"]))
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


@app.command()
def usage(all_tenants: bool = typer.Option(False, "--all-tenants",
                                           help="every tenant (admin token)"),
          as_json: bool = JsonOpt) -> None:
    """Jobs by state, GPU-seconds billed and time queued (never billed), per tenant and class."""
    rows = _call(_client().usage, all_tenants=all_tenants)
    if as_json:
        print_json(rows)
        return
    table = Table("tenant", "class", "jobs", "gpu-seconds", "run s", "queued s")
    for r in rows:
        jobs = ", ".join(f"{k} {v}" for k, v in sorted(r["jobs"].items()))
        table.add_row(r["tenant"], r["size_class"], jobs, f"{r['gpu_seconds']:.1f}",
                      f"{r['run_seconds']:.1f}", f"{r['queued_seconds']:.1f}")
    out.print(table)


@app.command()
def queue(as_json: bool = JsonOpt) -> None:
    """Each size class: GPUs, busy GPUs, and per tenant the queued jobs, GPUs running and
    share of them against share of weight (other tenants merged unless your token is admin)."""
    view = _call(_client().queue)
    if as_json:
        print_json(view)
        return
    unread = view.get("broker") == "unreachable"   # the heartbeats could not be read
    if unread:
        err.print("the broker (Redis) is unreachable: the pool's GPUs are unknown (shown ?), "
                  "and nothing is published until it is back", highlight=False)
    table = Table("class", "GPUs", "busy", "queued", "tenant", "queued", "running GPUs",
                  "used share", "weight share", "quota")
    for c in view["classes"]:
        first = True
        for t in c["tenants"] or [None]:
            gpus, busy = ("?", "?") if unread else (str(c["gpus"]), str(c["busy_gpus"]))
            head = [c["size_class"], gpus, busy, str(c["queued"])] if first else ["", "", "", ""]
            first = False
            if t is None:
                table.add_row(*head, "-", "", "", "", "", "")
                continue
            table.add_row(*head, t["tenant"], str(t["queued"]), str(t["running_gpus"]),
                          f"{t['used_share']:.0%}", f"{t['weight_share']:.0%}",
                          "-" if t["quota"] is None else str(t["quota"]))
    out.print(table)
    isolation = [f"{c['size_class']} {'/'.join(c['isolation'])}" for c in view["classes"]
                 if c.get("isolation")]
    if isolation:   # how each class's workers keep jobs apart (docs/security.md)
        out.print("isolation: " + ", ".join(isolation), highlight=False)
    network = [f"{c['size_class']} {'/'.join(c['network'])}" for c in view["classes"]
               if c.get("network")]
    if network:     # each class's jobs' network (docs/security.md, "A job's own network")
        out.print("network: " + ", ".join(network), highlight=False)
    shared = [c["size_class"] for c in view["classes"] if "host" in c.get("network", ())]
    if shared:
        err.print(f"warning: jobs of {', '.join(shared)} share their worker's network "
                  "(job_network = host, or isolation process): they reach the host's loopback "
                  "and the pool's own services (docs/security.md)")
    if view.get("tenants"):
        standing = Table("tenant", "weight", "decayed GPU-s", "usage share", "weight share")
        for t in view["tenants"]:
            standing.add_row(t["tenant"], f"{t['weight']:g}", f"{t['usage_gpu_s']:.0f}",
                             f"{t['usage_share']:.0%}", f"{t['weight_share']:.0%}")
        out.print(standing)
    for d in view.get("drained") or []:   # nodes out of service, and why
        out.print(f"out of service: {d['node']} since {d['since'][:19]}: {d['reason']}")
