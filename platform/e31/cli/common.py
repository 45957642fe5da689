"""What every `e31` command group shares: the consoles, exit codes, common options, and the
few helpers that turn an error into a message and an exit code.

Owns: `out`/`err`, the EXIT_* codes, the options several groups declare (`--home`, `--json`,
the worker-slot options of `e31 worker` and `e31 up`), `fail`, `print_json`, and how a command
loads its `Settings` and sets up logging.
May import: the `e31` core (light modules only at the top: `errors`), typer and rich.
Nothing here imports another CLI module; every group module imports this one.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

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
    (EXIT_INPUT, "bad input: a bad flag, a refused spec, an unknown job, a 403"),
    (EXIT_UNAVAILABLE, "a service is unavailable: the API, Redis or the store"),
    (EXIT_TIMEOUT, "not finished yet when the wait's --timeout passed (wait)"),
    (EXIT_INTERRUPTED, "interrupted (Ctrl-C)"),
)

LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"

out = Console()
err = Console(stderr=True)

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
