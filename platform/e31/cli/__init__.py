"""The `e31` command: the root app, built from one module per command group, and `main()`.

Groups: `submit`, `jobs` (status, ls, logs, result, cancel, wait), `queue` (usage, queue),
`retry`, `top`, `demo`, `ops` (worker, api, scheduler, flower, `db`), `stack` (up, down), `gc`,
`audit`, `tenants` (`tenant`), `tokens` (`token`), `secrets` (`secret`) and `batches` (`batch`,
`model`);
the pieces they share are in `common` (the job groups' client among them), which imports none
of them, and `remote` (what the admin groups share); no group imports another.
May import: everything; `e31_worker` only lazily, inside the commands that need it.
`pyproject.toml`'s `e31 = "e31.cli:main"` and `python -m e31.cli` both start `main()`.
"""

from __future__ import annotations

import logging
import sys

import typer
from rich.markup import escape
from typer._click.exceptions import NoArgsIsHelpError, UsageError

from e31.cli import (
    audit,
    batches,
    demo,
    gc,
    jobs,
    ops,
    queue,
    retry,
    secrets,
    stack,
    submit,
    tenants,
    tokens,
    top,
)
from e31.cli.common import (
    EXIT_CODES,
    EXIT_INPUT,
    EXIT_INTERRUPTED,
    EXIT_UNAVAILABLE,
    LOG_FORMAT,
    err,
    exit_code,
)
from e31.core.errors import ClientError, ConfigError, E31Error, SpecError

__all__ = ["app", "main"]


def build_app() -> typer.Typer:
    """The root app; the groups are added in the order `e31 --help` lists them."""
    # Help texts say "[env E31_…]": plain text, not Rich markup (which would swallow them).
    root = typer.Typer(help="E31 Batch: batch GPU jobs on a shared pool.", no_args_is_help=True,
                       add_completion=False, pretty_exceptions_enable=False,
                       rich_markup_mode=None, epilog=exit_codes_epilog())
    root.callback()(_root)
    for group in (submit.app, jobs.app, queue.app, retry.app, top.app, demo.app, ops.app,
                  stack.app, gc.app, audit.app):
        root.add_typer(group)       # no name: their commands sit at the top level
    root.add_typer(ops.db_app, name="db")
    root.add_typer(tenants.app, name="tenant")
    root.add_typer(tokens.app, name="token")
    root.add_typer(secrets.app, name="secret")
    root.add_typer(batches.app, name="batch")
    root.add_typer(batches.models_app, name="model")
    return root


def exit_codes_epilog() -> str:
    """The exit codes as `e31 --help` ends with them (`\\b`: Click keeps the lines as they are)."""
    rows = "\n".join(f"  {code:<4} {meaning}" for code, meaning in EXIT_CODES)
    return ("\b\nThe job commands reach the API at [env E31_URL] with [env E31_TOKEN], else "
            "through the\nprofile `e31 up` wrote in E31_HOME.\n\n\b\nExit codes (every command; "
            f"an error is one line on stderr):\n{rows}")


def _version(shown: bool) -> None:
    if shown:
        from e31 import __version__
        print(f"e31 {__version__}")
        raise typer.Exit(0)


def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="print the version (e31 X.Y.Z) and exit")) -> None:
    """E31 Batch: batch GPU jobs on a shared pool."""


app = build_app()


def main() -> None:
    """Run `e31`: an `E31Error` that escapes a command, and a flag or argument Click refuses,
    become one line `error: …` on stderr and an exit code (docs/operations.md, "Exit codes")."""
    logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT)
    try:
        code = app(standalone_mode=False)
    except NoArgsIsHelpError as exc:    # `e31` alone, or a group alone: its help
        print(exc.format_message(), file=sys.stderr)
        code = EXIT_INPUT
    except UsageError as exc:
        where = f" (see {exc.ctx.command_path} --help)" if exc.ctx else ""
        code = _one_line(exc.format_message() + where, EXIT_INPUT)
    except ClientError as exc:       # a 401 is the user's to fix (2), an outage is not (3)
        code = _one_line(exc.message, exit_code(exc))
    except E31Error as exc:
        code = _one_line(exc.message, EXIT_INPUT if isinstance(exc, (SpecError, ConfigError))
                         else EXIT_UNAVAILABLE)
    except typer.Abort:
        code = EXIT_INTERRUPTED
    sys.exit(code if isinstance(code, int) else 0)


def _one_line(message: str, code: int) -> int:
    """Print `error: message` as one line on stderr (never wrapped at the terminal's width,
    never read as markup); returns `code`."""
    err.print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
    return code
