"""What every `e31` command group shares: the consoles, exit codes, common options, and the
few helpers that turn an error into a message and an exit code.

Owns: `out`/`err`, the EXIT_* codes, the options several groups declare (`--home`, `--json`,
the worker-slot options of `e31 worker` and `e31 up`), `fail`, `print_json`, how a command
loads its `Settings` and sets up logging, how `queue` and `top` name a class's slots, and
what the job groups (`submit`, `jobs`, `queue`) share: `api_client`, the client they reach
the API with, `call`, and waiting on a job or an array.
May import: the `e31` core (light modules only at the top: `errors`), typer and rich, and
`e31.client` lazily, inside `api_client`, so that `e31 --help` stays fast.
Nothing here imports another CLI module; every group module imports this one.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import typer
from rich.console import Console, ConsoleDimensions
from rich.markup import escape

from e31.core.errors import ClientError, JobFailed, JobTimeout, SpecError

if TYPE_CHECKING:
    from e31.edge.settings import Settings

# Exit codes: 0 done; 1 the job failed (wait, result); 2 bad input (a refused spec, a bad
# flag); 3 the API or a service could not be reached or answered with another error; 4 the
# job was still running (or queued) when `--timeout` passed: neither a failure nor an outage,
# so a script can wait again (as timeout(1) has its own 124).
EXIT_FAILED, EXIT_INPUT, EXIT_UNAVAILABLE, EXIT_TIMEOUT = 1, 2, 3, 4
EXIT_INTERRUPTED = 130      # 128 + SIGINT, as a shell reports Ctrl-C

# The table `e31 --help` ends with, and docs/operations.md ("Exit codes") shows the same
# (tests/unit/test_cli_flags.py holds the two together).
EXIT_CODES: tuple[tuple[int, str], ...] = (
    (0, "done"),
    (EXIT_FAILED, "the job failed, timed out or was cancelled (wait, result)"),
    (EXIT_INPUT, "bad input: a bad flag, a refused spec, an unknown job, a 401 or 403, "
                 "no API address or token"),
    (EXIT_UNAVAILABLE, "a service is unavailable: the API, Redis or the store"),
    (EXIT_TIMEOUT, "not finished yet when the wait's --timeout passed (wait)"),
    (EXIT_INTERRUPTED, "interrupted (Ctrl-C)"),
)

# The API's answers that refuse the request itself, which the caller can fix (exit 2): 401,
# a token unknown, revoked or expired, among them, as the user's setup and not an outage.
INPUT_STATUSES = frozenset({400, 401, 403, 404, 409, 413, 422})

LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
ARRAY_PREFIX = "a-"        # array ids; job ids start with "j-"

# Off a terminal rich lays out at 80 columns and cuts table cells to fit ("atte… work…"): a
# pipe, a file, CI's log or `watch` get the lines at their own width instead, up to this.
OFF_TERMINAL_WIDTH = 4096


class _Console(Console):
    """rich's Console, as wide as its lines off a terminal (no COLUMNS, no width given): a
    table's cells and ids whole in a pipe (issue 32). On a terminal, or with COLUMNS set,
    rich's own width."""

    @property
    def size(self) -> ConsoleDimensions:
        size = Console.size.fget(self)  # type: ignore[attr-defined]
        columns = self._environ.get("COLUMNS", "")
        if self._width is None and not self.is_terminal and not columns.isdigit():
            return ConsoleDimensions(OFF_TERMINAL_WIDTH, size.height)
        return size

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)  # type: ignore[attr-defined]


out = _Console()
err = _Console(stderr=True)

# Help texts say "[env E31_…]": plain text, not Rich markup (which would swallow them).
HomeOpt = typer.Option(None, "--home", envvar="E31_HOME",
                       help="state directory [env E31_HOME, default ~/.e31]")
JsonOpt = typer.Option(False, "--json", help="print JSON")

# The worker slots of one machine: `e31 worker` starts them, `e31 up` passes them on.
GpusOpt = typer.Option("all", "--gpus", help="GPUs to serve: all, 0,1 or 0-3")
SimulateGpusOpt = typer.Option(None, "--simulate-gpus",
                               help="pretend GPUs, e.g. 2x24,1x80 (no GPU needed)")
SpillOpt = typer.Option(True, "--spill/--no-spill", help="also take smaller GPU classes")
GroupOpt = typer.Option(1, "--group", help="GPUs per worker process, for multi-GPU jobs")
GangsOpt = typer.Option(None, "--gangs/--static", help="gangs on demand (the default without "
                        "--group): one worker per GPU, and the scheduler gives each job the GPUs "
                        "it asks for (1, 2, 4 or 8 of one node); --static pins each worker "
                        "process to its GPU (or --group) for good (docs/scheduling.md)")
IsolationOpt = typer.Option(None, "--isolation", help="sandbox (each job as its own user, in "
                            "its own namespaces) or process (as the worker's user) "
                            "[env E31_ISOLATION]")


def fail(message: str, code: int) -> NoReturn:
    """Print `error: message` on stderr (the message as plain text) and exit with `code`."""
    err.print(f"[red]error:[/red] {escape(message)}", highlight=False, markup=True, soft_wrap=True)
    raise typer.Exit(code)


def print_json(value: Any) -> None:
    out.print_json(json.dumps(value))


def load_settings(**overrides: Any) -> Settings:
    """The settings of this command: its flags (None: not given) over E31_* and the file."""
    from e31.edge.settings import Settings
    return Settings.load(overrides)


def setup_logging(level: str) -> None:
    """Log at `level` (a name such as INFO) for a long-running service command."""
    logging.basicConfig(level=level.upper(), force=True, format=LOG_FORMAT)


# -- the job groups' client --------------------------------------------------------------

def api_client(url: str | None = None, token: str | None = None) -> Any:
    """The API client of `url`/`token`, else E31_URL/E31_TOKEN, else the profile `e31 up`
    wrote. None known is the user's setup to fix: exit 2 (making the client sends nothing,
    so that is the only error it raises)."""
    from e31.client import Client
    config = os.environ.get("E31_CONFIG")
    if config and not Path(config).expanduser().is_file():   # as every command says it
        fail(f"E31_CONFIG: no such file {Path(config).expanduser()}", EXIT_INPUT)
    try:
        return Client(url, token) if url or token else Client()
    except ClientError as exc:
        fail(exc.message, EXIT_INPUT)


def exit_code(exc: ClientError) -> int:
    """A client error's exit code: 2 for a request the API refused (INPUT_STATUSES), else 3
    (the API unreachable, or answering with an error of its own)."""
    return EXIT_INPUT if exc.status_code in INPUT_STATUSES else EXIT_UNAVAILABLE


def call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run a client call, turning its errors into a one-line message and an exit code."""
    try:
        return fn(*args, **kwargs)
    except JobFailed:
        raise
    except JobTimeout as exc:    # still running: neither failed nor unavailable
        fail(exc.message, EXIT_TIMEOUT)
    except ClientError as exc:
        fail(exc.message, exit_code(exc))
    except SpecError as exc:     # found before a request was sent: a workdir or input path
        fail(exc.message, EXIT_INPUT)


def is_array(some_id: str) -> bool:
    return some_id.startswith(ARRAY_PREFIX)


def counts(st: dict[str, Any]) -> str:
    """An array's progress as one line: "7/10 done: 6 succeeded, 1 failed, 3 running"."""
    shown = [f"{st[k]} {k}" for k in ("succeeded", "failed", "cancelled", "running", "queued")
             if st.get(k)]
    return f"{st['done']}/{st['total']} done" + (f": {', '.join(shown)}" if shown else "")


def say_id_first(handle: Any) -> None:
    """`e31 submit --wait`: the id alone on stdout, at once, so that `J=$(e31 submit --wait …)`
    holds the id (a terminal shows it while the wait goes on); `outcome_to_stderr` of
    `wait_job` and `wait_array` then puts the outcome on stderr (issue 32)."""
    print(handle.id, flush=True)


def wait_job(job: Any, *, as_json: bool, timeout: float | None,
             outcome_to_stderr: bool = False) -> None:
    """Wait for `job` with a progress bar (none with --json); exit 1 unless it succeeded.
    The outcome line goes to stdout (`e31 wait`) or, with `outcome_to_stderr`, to stderr."""
    try:
        st = call(job.wait, timeout=timeout, progress=not as_json)
    except JobFailed as exc:
        if as_json:
            print_json(exc.status)
        fail(exc.message, EXIT_FAILED)
    if as_json:
        print_json(st)
    else:
        line = f"{job.id} succeeded: {json.dumps(st['result'])}"
        if outcome_to_stderr:
            err.print(line, highlight=False, markup=False, soft_wrap=True)
        else:
            print(line)


def wait_array(array: Any, *, as_json: bool, timeout: float | None,
               outcome_to_stderr: bool = False) -> None:
    """Wait for every item of `array`; exit 1 naming the first items that did not succeed.
    The summary goes to stdout (`e31 wait`) or, with `outcome_to_stderr`, to stderr."""
    st = call(array.wait, timeout=timeout, progress=not as_json)
    if as_json:
        print_json(st)
    else:
        (err if outcome_to_stderr else out).print(f"{array.id} {st['state']}, {counts(st)}",
                                                  highlight=False)
    if st["state"] != "succeeded":
        bad = [i for i in st.get("items", []) if i["state"] != "succeeded"]
        listed = ", ".join(f"[{i['index']}] {i['id']} {i['reason'] or i['state']}" for i in bad[:5])
        fail(f"array {array.id}: {st['failed']} failed, {st['cancelled']} cancelled of "
             f"{st['total']}" + (f" ({listed}{', …' if len(bad) > 5 else ''})" if listed else ""),
             EXIT_FAILED)


def slots_text(c: dict[str, Any]) -> str:
    """A size class's slots as `e31 queue` and `e31 top` print them, with what they are:
    `2 GPU`, or `1 CPU` for a CPU class's workers (`slot_kind`; an older API sends none, and
    counted GPUs alone)."""
    return f"{c['gpus']} {'CPU' if c.get('slot_kind') == 'cpu' else 'GPU'}"
