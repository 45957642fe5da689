"""`e31 demo`: the command only — its options, exit code and error messages.

Owns: the `demo` command. The pipeline itself (stack, jobs, progress, summary) lives in
`e31.local.demo`. May import: `e31.cli.common`, the `e31` core, and `e31.local.demo` lazily
inside the command (it pulls in the client and the stack).
"""

from __future__ import annotations

from pathlib import Path

import typer

from e31.cli.common import (
    EXIT_INPUT,
    EXIT_INTERRUPTED,
    EXIT_UNAVAILABLE,
    HomeOpt,
    JsonOpt,
    err,
    fail,
    load_settings,
    out,
)
from e31.core.errors import ConfigError, E31Error

app = typer.Typer()


@app.command()
def demo(home: Path | None = HomeOpt,
         keep: bool = typer.Option(False, "--keep",
                                   help="leave a stack the demo started running"),
         out_dir: Path | None = typer.Option(None, "--out", help="where the inputs and the "
                                             "downloaded outputs go "
                                             "(default: $E31_HOME/demo/<time>)"),
         as_json: bool = JsonOpt) -> None:
    """The main job: train a digits classifier, score the held-out digits with its weights,
    label a rendered clip frame by frame and sweep learning rates, on this machine's stack
    (started, and stopped after, if none runs). Exit 1 unless every job succeeded."""
    from e31.local.demo import DemoOptions, run
    options = DemoOptions(home=load_settings(home=home).home, out=out_dir, keep=keep,
                          as_json=as_json)
    try:
        code = run(options, out=out, err=err)
    except KeyboardInterrupt:
        err.print("e31 demo interrupted")
        code = EXIT_INTERRUPTED
    except E31Error as exc:
        fail(exc.message, EXIT_INPUT if isinstance(exc, ConfigError) else EXIT_UNAVAILABLE)
    raise typer.Exit(code)
