"""The `e31` command: the root app, built from one module per command group, and `main()`.

Groups: `jobs` (submit, status, ls, logs, result, cancel, wait, usage, queue), `top`, `demo`,
`ops` (worker, api, scheduler, flower, `db`), `stack` (up, down), `gc` and `tenants` (`tenant`);
the pieces they share are in `common`, which imports none of them, and no group imports another.
May import: everything; `e31_worker` only lazily, inside the commands that need it.
`pyproject.toml`'s `e31 = "e31.cli:main"` and `python -m e31.cli` both start `main()`.
"""

from __future__ import annotations

import logging
import sys

import typer

from e31.cli import demo, gc, jobs, ops, stack, tenants, top
from e31.cli.common import EXIT_INPUT, EXIT_UNAVAILABLE, LOG_FORMAT, err
from e31.errors import ConfigError, E31Error, SpecError

__all__ = ["app", "main"]


def build_app() -> typer.Typer:
    """The root app; the groups are added in the order `e31 --help` lists them."""
    # Help texts say "[env E31_…]": plain text, not Rich markup (which would swallow them).
    root = typer.Typer(help="E31 Batch: batch GPU jobs on a shared pool.", no_args_is_help=True,
                       add_completion=False, pretty_exceptions_enable=False,
                       rich_markup_mode=None)
    for group in (jobs.app, top.app, demo.app, ops.app, stack.app, gc.app):
        root.add_typer(group)       # no name: their commands sit at the top level
    root.add_typer(ops.db_app, name="db")
    root.add_typer(tenants.app, name="tenant")
    return root


app = build_app()


def main() -> None:
    """Run `e31`: an `E31Error` that escapes a command becomes `error: …` and an exit code."""
    logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT)
    try:
        app()
    except E31Error as exc:
        err.print(f"[red]error:[/red] {exc.message}")
        sys.exit(EXIT_INPUT if isinstance(exc, (SpecError, ConfigError)) else EXIT_UNAVAILABLE)
