"""`e31 up` and `e31 down`: the whole stack on this machine, in the foreground or detached.

Owns: these two commands and how `up -d` starts `e31 up` in the background and waits for it.
The stack itself (Redis, store, API, scheduler, workers, Flower) is `e31.local.stack`.
May import: `e31.cli.common`, the `e31` core, `e31.local` lazily inside the commands, and
`e31_worker`'s GPU discovery lazily in `e31 up`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from e31.cli.common import (
    EXIT_INPUT,
    EXIT_UNAVAILABLE,
    GangsOpt,
    GpusOpt,
    GroupOpt,
    HomeOpt,
    IsolationOpt,
    JsonOpt,
    SimulateGpusOpt,
    SpillOpt,
    err,
    load_settings,
    out,
    print_json,
)
from e31.core.errors import ConfigError, E31Error

if TYPE_CHECKING:
    from e31.edge.settings import Settings

DETACH_READY_TIMEOUT_S = 120.0
DETACH_POLL_S = 0.3

app = typer.Typer()


@app.command()
def up(gpus: str = GpusOpt,
       cpu_slots: int | None = typer.Option(None, "--cpu-slots", help="cpu-class workers "
                                            "(default: 1, or 2 without GPUs)"),
       simulate_gpus: str | None = SimulateGpusOpt, spill: bool = SpillOpt,
       group: int = GroupOpt, gangs: bool | None = GangsOpt, home: Path | None = HomeOpt,
       port: int | None = typer.Option(None, "--port", help="API port [env E31_API_PORT]"),
       flower_port: int | None = typer.Option(None, "--flower-port",
                                              help="Flower's port [env E31_FLOWER_PORT]"),
       no_flower: bool = typer.Option(False, "--no-flower", help="start no Flower"),
       detach: bool = typer.Option(False, "--detach", "-d",
                                   help="return once ready; `e31 down` stops it"),
       isolation: str | None = IsolationOpt, as_json: bool = JsonOpt) -> None:
    """Start the whole stack on this machine: Redis, store, API, scheduler, workers, Flower."""
    settings = load_settings(home=home, api_port=port, flower_port=flower_port,
                             isolation=isolation)
    if detach:    # before the stack's imports: the child it starts pays them, once
        _detach(settings, as_json=as_json)
        return
    from e31.local.stack import LocalStack
    from e31_worker.node.gpus import discover
    real = [] if simulate_gpus else discover()
    slots = cpu_slots if cpu_slots is not None else (1 if (real or simulate_gpus) else 2)
    if not real and not simulate_gpus:
        err.print("no GPU found: serving the cpu class only "
                  "(add --simulate-gpus 1x24 to try GPU routing)")
    worker_args = _worker_argv(gpus, slots, simulate_gpus, spill, group, gangs)
    worker_args += ["--isolation", _isolation(settings, chosen=isolation is not None)]
    stack = LocalStack(settings=settings, flower=not no_flower, worker_args=worker_args)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stack.request_stop())
    try:
        profile = stack.start()
        flower_line = (f"Flower {profile['flower_url']} (user {profile['flower_user']}, "
                       f"password in {settings.profile_path})") if not no_flower else "Flower off"
        print(json.dumps(_ready(settings, profile)) if as_json else
              f"E31 Batch is ready: API {profile['url']}, {flower_line}, "
              f"{_metrics_line(settings, profile['url'])}. Ctrl-C or `e31 down` stops it.")
        sys.stdout.flush()
        stack.supervise()
    except E31Error as exc:
        err.print(f"error: {exc.message}")
        stack.stop()
        raise typer.Exit(EXIT_INPUT if isinstance(exc, ConfigError) else EXIT_UNAVAILABLE) \
            from None
    stack.stop()
    if as_json:     # JSON lines: the ready line, then this one
        print(json.dumps({"state": "stopped", "home": str(settings.home)}))
    else:
        out.print("E31 Batch stopped.")


@app.command()
def down(home: Path | None = HomeOpt, as_json: bool = JsonOpt) -> None:
    """Stop the stack `e31 up` started from this home (running jobs are drained)."""
    from e31.local.state import stop_stack
    settings = load_settings(home=home)
    stopped = stop_stack(settings.home)
    if as_json:
        print_json({"stopped": stopped, "home": str(settings.home)})
    elif stopped:
        out.print("E31 Batch stopped.")
    else:
        out.print(f"no running stack in {settings.home}")


def _worker_argv(gpus: str, cpu_slots: int, simulate_gpus: str | None, spill: bool,
                 group: int, gangs: bool | None = None) -> list[str]:
    """The `e31 worker` flags of the stack's worker launcher."""
    argv = ["--gpus", gpus, "--cpu-slots", str(cpu_slots), "--group", str(group),
            "--spill" if spill else "--no-spill"]
    if gangs is not None:
        argv.append("--gangs" if gangs else "--static")
    if simulate_gpus:
        argv += ["--simulate-gpus", simulate_gpus]
    return argv


def _metrics_line(settings: Settings, url: str) -> str:
    """Where the metrics are and which token they want (never the token itself)."""
    from e31.local.stack import METRICS_TOKEN_FILE
    where = ("the token you set" if settings.metrics_token or settings.metrics_token_file
             else f"token in {settings.home / METRICS_TOKEN_FILE}")
    return f"metrics {url}/metrics ({where})"


def _isolation(settings: Settings, *, chosen: bool) -> str:
    """The stack's isolation: the sandbox where this host can give one; else, unless the
    sandbox was asked for by flag, each job as the user who runs `e31 up`, with a warning."""
    if settings.isolation != "sandbox":
        return settings.isolation
    from e31_worker.attempt.sandbox import network_unavailable, sandbox_unavailable
    why = sandbox_unavailable(settings)
    if why is None:
        if (no_net := network_unavailable(settings)) is not None:
            if chosen or "E31_JOB_NETWORK" in os.environ:   # asked for: no quiet fallback
                err.print(f"error: {no_net}")
                raise typer.Exit(EXIT_INPUT)
            # One machine, one user, as the fallback to `process` below: the stack's jobs
            # share its network, said loudly here and by `e31 queue` (docs/security.md).
            err.print(f"warning: jobs share this machine's network ({no_net})")
            os.environ["E31_JOB_NETWORK"] = "host"   # the stack's workers inherit it
        return "sandbox"
    if chosen:
        err.print(f"error: cannot run jobs in a sandbox on this host: {why}")
        raise typer.Exit(EXIT_INPUT)
    err.print(f"warning: jobs run without a sandbox, as your own user ({why}); "
              "see docs/security.md")
    return "process"


def _ready(settings: Settings, profile: dict[str, Any]) -> dict[str, Any]:
    """`e31 up --json`'s ready line (one JSON object a line, then `{"state": "stopped"}` at
    the end): where the stack listens, never a token or password."""
    return {"state": "ready", "url": profile["url"], "flower_url": profile.get("flower_url"),
            "metrics_url": f"{profile['url']}/metrics", "home": str(settings.home),
            "profile": str(settings.profile_path)}


def _detach(settings: Settings, *, as_json: bool) -> None:
    """Run `e31 up` (without -d) in the background and return when it is ready."""
    from e31.local.state import STATE_FILE, stack_ready
    home = settings.home
    argv = [a for a in sys.argv[1:] if a not in ("-d", "--detach")]
    home.mkdir(parents=True, exist_ok=True)
    (home / "logs").mkdir(exist_ok=True)
    log_path = home / "logs" / "up.log"
    (home / STATE_FILE).unlink(missing_ok=True)
    with open(log_path, "ab") as log:   # the child keeps its own copy of the descriptor
        start = log.seek(0, os.SEEK_END)   # this run's lines begin here: earlier runs' end above
        proc = subprocess.Popen([sys.executable, "-m", "e31.cli", *argv],
                                env=dict(os.environ, E31_HOME=str(home)), stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    deadline = time.monotonic() + DETACH_READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err.print(f"error: e31 up exited with code {proc.returncode}; see {log_path}")
            raise typer.Exit(proc.returncode or EXIT_UNAVAILABLE)
        if stack_ready(home) and as_json:
            print(json.dumps(_ready(settings, json.loads(settings.profile_path.read_text()))))
            return
        # The state file says ready a moment before the child prints its line: wait for this
        # run's own line (a line of an earlier run above `start` is never taken for it)
        line = _ready_line(log_path, start) if stack_ready(home) else None
        if line is not None:
            print(line)
            return
        time.sleep(DETACH_POLL_S)
    err.print(f"error: the stack was not ready in {DETACH_READY_TIMEOUT_S:g} s; see {log_path}")
    raise typer.Exit(EXIT_UNAVAILABLE)


def _ready_line(log_path: Path, start: int) -> str | None:
    """The "is ready" line `e31 up` printed into `log_path` after offset `start`, or None."""
    with open(log_path, "rb") as log:
        log.seek(start)
        lines = log.read().decode(errors="replace").splitlines()
    return next((line for line in reversed(lines) if "is ready" in line), None)
