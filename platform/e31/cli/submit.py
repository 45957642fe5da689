"""`e31 submit`: a job (or, with a sweep, an array of jobs) from a spec file, flags, or
`-- argv...` for a command job; every spec field has a flag, and a flag wins over the file.

A client of the HTTP API (`e31.client`, through `e31.cli.common`). `--dry-run` asks the API
what would be stored and uploaded, and submits nothing.
Owns: the `submit` command, its flags, how they merge over the spec file and a sweep, and how
a submission prints. May import: `e31.cli.common`, `e31.cli.common`, the `e31` core, and
`e31.client` and `e31.ops.sweep` (lazily, inside the command, so that `e31 --help` stays fast).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.table import Table
from rich.text import Text

from e31.cli.common import (
    EXIT_INPUT,
    JsonOpt,
    api_client,
    call,
    err,
    fail,
    out,
    print_json,
    say_id_first,
    wait_array,
    wait_job,
)
from e31.core.errors import SpecError

if TYPE_CHECKING:
    from e31.ops.sweep import Sweep

app = typer.Typer()

NO_WORKERS = "no_workers"   # a queued job's pending reason: no live worker serves its queue
                            # (e31.scheduling.explain.NO_WORKERS, the API's word)
NO_SCHEDULER = "no_scheduler"   # no scheduler runs (e31.scheduling.explain.NO_SCHEDULER)

# The flags of `e31 submit`, in the order its --help lists them.
SpecFileArg = typer.Argument(None, help="a job spec in YAML or JSON")
EntrypointOpt = typer.Option(None, "--entrypoint", "-e", help="module:function")
WorkloadOpt = typer.Option(
    None, "--workload", "-w", help="a built-in workload: batch-inference, train, footage "
                                   "(the job is named after it unless --name)")
ParamOpt = typer.Option([], "--param", "-p", help="KEY=VALUE (VALUE parsed as JSON if it can be)")
EnvOpt = typer.Option([], "--env", help="KEY=VALUE for the job's environment")
GpusOpt = typer.Option(None, "--gpus", help="GPUs (0: the cpu class)")
GpuMemOpt = typer.Option(None, "--gpu-mem", help="GB of GPU memory needed")
SizeClassOpt = typer.Option(None, "--size-class", help="e.g. gpu80")
MemGbOpt = typer.Option(
    None, "--mem-gb", help="GB of host memory the job may use (past it: reason oom)")
DiskGbOpt = typer.Option(
    None, "--disk-gb", help="GB its scratch, outputs and checkpoints may fill (past it: "
                            "reason disk_quota); default: the pool's attempt_disk_gb")
OnOomOpt = typer.Option(
    None, "--on-oom", help="after an attempt that ran out of memory: next_class (queue it "
                           "in the next bigger size class) or fail (retry it in its own); "
                           "default: the pool's on_oom_default")
AllowPendingOpt = typer.Option(
    False, "--allow-pending", help="store the job even when no registered node has the "
                                   "GPUs it asks for (refused otherwise); it waits until "
                                   "such a node joins")
PreemptibleOpt = typer.Option(
    None, "--preemptible/--not-preemptible",
    help="whether the scheduler may stop the job (it gets SIGTERM and its grace to "
         "checkpoint) for a job of a higher band or a tenant below its share, and requeue "
         "it to resume from its checkpoint; default: only the training workload")
TimeoutOpt = typer.Option(None, "--timeout", help="seconds per attempt")
RetriesOpt = typer.Option(None, "--retries", help="retries after a failed attempt")
BackoffOpt = typer.Option(None, "--backoff", help="first retry delay, seconds")
BackoffMaxOpt = typer.Option(
    None, "--backoff-max", help="longest retry delay, seconds (the delay doubles up to it)")
MaxLostOpt = typer.Option(
    None, "--max-lost", help="attempts lost with their worker before the job fails as a "
                             "poison job")
PriorityOpt = typer.Option(None, "--priority", help="0..9, higher first")
NameOpt = typer.Option(None, "--name", help="a name for people (default: the "
                                            "workload, function or command)")
AfterOpt = typer.Option(
    [], "--after", help="a job id (j-…) or array id (a-…) that must succeed first "
                        "(repeatable)")
PipOpt = typer.Option([], "--pip", help="a pip requirement to install for the "
                                        "job, e.g. 'tqdm==4.66' (repeatable)")
RequirementsOpt = typer.Option(
    None, "--requirements", help="a requirements file in the job's code (--workdir), "
                                 "relative to it")
InputOpt = typer.Option(
    [], "--input", help="NAME=SOURCE staged into $E31_INPUT_DIR/NAME: a local path, "
                        "file://, s3://, http(s):// or bundle:… (repeatable)")
NetworkOpt = typer.Option(
    None, "--network", help="none: the job gets no network at all (sandboxed workers)")
SecretOpt = typer.Option(
    [], "--secret", help="a secret of your tenant (e31 secret set NAME) given to the job "
                         "as the variable NAME (repeatable)")
IdleTimeoutOpt = typer.Option(
    None, "--idle-timeout", help="seconds without log output, progress or GPU use after "
                                 "which the job counts as idle")
OnIdleOpt = typer.Option(None, "--on-idle", help="flag (show it) or kill (stop it, reason idle)")
CodeOpt = typer.Option(
    None, "--code", help="sha256:<hex> of a bundle already uploaded (instead of --workdir)")
SweepOpt = typer.Option(
    None, "--sweep", help="a sweep file (grid: or list: of params): one job per item, "
                          "submitted as one array over the spec file and flags")
WaitOpt = typer.Option(False, "--wait", help="wait for the end, with a progress bar: the id "
                       "alone on stdout, the outcome on stderr (--json: the status)")
WorkdirOpt = typer.Option(
    None, "--workdir", help="send this directory as the job's code: the job starts in it, "
                            "with it first on PYTHONPATH (.gitignore and .e31ignore apply)")
DryRunOpt = typer.Option(False, "--dry-run", help="check the job and print what would be stored "
                                                  "and uploaded; submit and upload nothing")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": False})
def submit(
    spec_file: Path | None = SpecFileArg,
    entrypoint: str | None = EntrypointOpt,
    workload: str | None = WorkloadOpt,
    param: list[str] = ParamOpt,
    env: list[str] = EnvOpt,
    gpus: int | None = GpusOpt,
    gpu_mem_gb: float | None = GpuMemOpt,
    size_class: str | None = SizeClassOpt,
    mem_gb: float | None = MemGbOpt,
    disk_gb: float | None = DiskGbOpt,
    on_oom: str | None = OnOomOpt,
    allow_pending: bool = AllowPendingOpt,
    preemptible: bool | None = PreemptibleOpt,
    timeout_s: float | None = TimeoutOpt,
    retries: int | None = RetriesOpt,
    backoff_s: float | None = BackoffOpt,
    backoff_max_s: float | None = BackoffMaxOpt,
    max_lost: int | None = MaxLostOpt,
    priority: int | None = PriorityOpt,
    name: str | None = NameOpt,
    after: list[str] = AfterOpt,
    pip: list[str] = PipOpt,
    requirements: str | None = RequirementsOpt,
    inputs: list[str] = InputOpt,
    network: str | None = NetworkOpt,
    secrets: list[str] = SecretOpt,
    idle_timeout_s: int | None = IdleTimeoutOpt,
    on_idle: str | None = OnIdleOpt,
    code: str | None = CodeOpt,
    sweep_file: Path | None = SweepOpt,
    wait: bool = WaitOpt,
    workdir: Path | None = WorkdirOpt,
    dry_run: bool = DryRunOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Submit a job: a spec file, or flags, or `-- argv...` for a command job; with a sweep
    file (--sweep, or as the spec file), an array of jobs. Every spec field has a flag, and
    a flag wins over the spec file."""
    argv = sys.argv[sys.argv.index("--") + 1:] if "--" in sys.argv else []
    if argv and spec_file is not None and str(spec_file) == argv[0]:
        spec_file = None  # Click hands the first word after `--` to the positional argument
    body, sweep, sweep_file = _read_spec(spec_file, sweep_file)
    _set_given(body, None, workdir=str(workdir) if workdir is not None else None,
               command=argv or None, entrypoint=entrypoint, workload=workload)
    _add_items(body, params=_pairs(param, "--param"), env=_pairs(env, "--env"),
               inputs=_pairs(inputs, "--input"), after=after, secrets=secrets, pip=pip)
    _set_given(body, "python", requirements=requirements)
    _set_given(body, "resources", gpus=gpus, gpu_mem_gb=gpu_mem_gb, size_class=size_class,
               mem_gb=mem_gb, disk_gb=disk_gb, on_oom=on_oom)
    _set_given(body, "retries", max=retries, backoff_s=backoff_s, backoff_max_s=backoff_max_s,
               max_lost=max_lost)
    _set_given(body, None, timeout_s=timeout_s, priority=priority, name=name, network=network,
               idle_timeout_s=idle_timeout_s, on_idle=on_idle, code=code,
               allow_pending=allow_pending or None, preemptible=preemptible)
    array_name = _names(body, sweep, sweep_file)
    _check_finite(body)
    client = api_client()
    if dry_run:
        _dry_run(client, body, sweep, as_json=as_json)
    elif sweep is not None:
        _submit_array(client, body, sweep, str(array_name), wait=wait, as_json=as_json)
    else:
        _submit_job(client, body, wait=wait, as_json=as_json)


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


def _add_items(body: dict[str, Any], *, params: dict[str, Any], env: dict[str, Any],
               inputs: dict[str, Any], after: list[str], secrets: list[str],
               pip: list[str]) -> None:
    """Add the repeatable flags to the spec's own: KEY=VALUE pairs over its mappings, and
    --after, --secret and --pip after its lists."""
    for key, given in (("params", params), ("env", env), ("inputs", inputs)):
        if given:
            body[key] = {**body.get(key, {}), **given}
    for key, values in (("after", after), ("secrets", secrets)):
        if values:
            body[key] = [*body.get(key, []), *values]
    if pip:
        body["python"] = {**(body.get("python") or {}),
                          "pip": [*(body.get("python") or {}).get("pip", []), *pip]}


def _names(body: dict[str, Any], sweep: Sweep | None, sweep_file: Path | None) -> str | None:
    """The array's name (None without a sweep), taken out of `body`; and the jobs' name when
    a workload names them."""
    # A sweep's --name (or name:) names the array; the spec's name, each job.
    array_name = None if sweep is None else body.pop("name", None) or Path(str(sweep_file)).stem
    if isinstance(body.get("workload"), str) and not body.get("name"):
        body["name"] = body["workload"]    # `-w train` is named train, not after its function
    return array_name


def _submit_job(client: Any, body: dict[str, Any], *, wait: bool, as_json: bool) -> None:
    job = call(client.submit, body)
    _say_bundles(client)
    if wait:
        if not as_json:             # the wait says why the job waits, at once (follow)
            say_id_first(job)
        wait_job(job, as_json=as_json, timeout=None, outcome_to_stderr=not as_json)
        return
    status = call(job.status)       # the submit answer has no `pending`; the job's status has
    _warn_unserved(status)
    if as_json:
        print_json(status)
    else:
        out.print(job.id)


def _warn_unserved(status: dict[str, Any]) -> None:
    """On stderr, when no live worker serves the job's queue, or no scheduler runs: it would
    wait until one is started, and nothing else says so (issue 32)."""
    pending = status.get("pending") or {}
    if status.get("state") != "queued":
        return
    if pending.get("reason") == NO_WORKERS:
        err.print(f"warning: {status['id']} waits: {pending['text']}; it starts only once such "
                  "a worker is started", highlight=False, markup=False, soft_wrap=True)
    elif pending.get("reason") == NO_SCHEDULER:
        err.print(f"warning: {status['id']} waits: {pending['text']}", highlight=False,
                  markup=False, soft_wrap=True)


def _submit_array(client: Any, body: dict[str, Any], sweep: Sweep, name: str, *, wait: bool,
                  as_json: bool) -> None:
    array = call(client.submit_many, sweep.items(), name=name, **body)
    _say_bundles(client)
    if wait:
        if not as_json:
            say_id_first(array)
        wait_array(array, as_json=as_json, timeout=None, outcome_to_stderr=not as_json)
    elif as_json:
        print_json(call(array.status))
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


FANOUT_FILES_SHOWN = 20     # a footage dry run's text lists this many files, then counts the rest


def _fanout_rows(table: Table, fanout: dict[str, Any]) -> None:
    """A footage source's plan in a dry run's text (issue 32, rough edge 9: only --json showed
    it): how many chunk jobs, files and frames, then each file with its chunks."""
    files = fanout.get("files") or []
    frames = fanout.get("total_frames")
    table.add_row("[bold]chunks[/bold]", f"{fanout['items']} jobs, then one merge job")
    table.add_row("[bold]files[/bold]", str(len(files)))
    table.add_row("[bold]frames[/bold]", f"{frames:,}" if frames else "every frame (fps: null)")
    for f in files[:FANOUT_FILES_SHOWN]:
        length = f" {f['duration_s']:g} s," if f.get("duration_s") is not None else ""
        chunks = len(f.get("items") or [])
        table.add_row("[bold]file[/bold]", Text(f"{f['name']} ({f['kind']},{length} "
                                                 f"{chunks} chunk{'' if chunks == 1 else 's'})"))
    if len(files) > FANOUT_FILES_SHOWN:
        table.add_row("[bold]file[/bold]", f"… and {len(files) - FANOUT_FILES_SHOWN} more "
                                            "(--json lists every one)")


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
    answer = call(client.dry_run, body)
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
    if answer.get("fanout"):
        _fanout_rows(table, answer["fanout"])
    for up in answer["uploads"]:
        table.add_row("[bold]upload[/bold]", f"{up['field']}: {up['digest']} ({up['files']} "
                                               f"files, {up['size_bytes']} bytes)")
    out.print(table)
    out.print("dry run: nothing was submitted or uploaded")
