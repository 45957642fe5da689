"""`e31` service commands an operator runs: worker (and its --drain), api, scheduler, flower,
and the `db` group (`e31 db upgrade`).

Owns: these commands and the `db` sub-app. Every object is built through `e31.edge.wiring`.
May import: `e31.cli.common`, the `e31` core and store, and, lazily inside the commands
(`e31 --help` stays fast), the API, the scheduler, Celery, uvicorn and `e31_worker` (only in
`e31 worker`).
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

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
    fail,
    load_settings,
    out,
    print_json,
    setup_logging,
)
from e31.core.errors import E31Error

if TYPE_CHECKING:
    from e31.edge.settings import Settings
    from e31.store import Repo

DRAIN_EXTRA_S = 60.0        # beyond the kill grace: a job's checkpoint upload and the record
DRAIN_POLL_S = 0.5          # how often --drain asks the store whether the jobs were requeued

app = typer.Typer()
db_app = typer.Typer(help="The results store.", no_args_is_help=True, rich_markup_mode=None)


@app.command()
def worker(gpus: str = GpusOpt,
           cpu_slots: int = typer.Option(0, "--cpu-slots",
                                         help="worker processes for the cpu class"),
           simulate_gpus: str | None = SimulateGpusOpt, spill: bool = SpillOpt,
           group: int = GroupOpt,
           gangs: bool | None = GangsOpt,
           hostname: str | None = typer.Option(None, "--hostname", help="node-name suffix "
                                               "(default: this host's name)"),
           home: Path | None = HomeOpt,
           loglevel: str = typer.Option("INFO", "--loglevel", help="DEBUG, INFO, WARNING, ERROR"),
           drain: bool = typer.Option(False, "--drain", help="drain the live workers of this "
                                      "host (or --hostname, or --node) instead of starting any"),
           node: list[str] = typer.Option([], "--node",
                                          help="with --drain: a node name, e.g. gpu0@host"),
           wait: bool = typer.Option(True, "--wait/--no-wait",
                                     help="with --drain: wait until they stopped"),
           undrain: bool = typer.Option(False, "--undrain", help="put drained nodes of this "
                                        "host (or --hostname, or --node) back in service: a "
                                        "launcher started with --keep-drains (`e31 up`'s) "
                                        "starts them again"),
           keep_drains: bool = typer.Option(False, "--keep-drains", help="leave nodes drained "
                                            "in the store stopped, also across restarts, "
                                            "until --undrain (default: starting clears the "
                                            "drains of its nodes)"),
           isolation: str | None = IsolationOpt,
           preload: str | None = typer.Option(None, "--preload", help="more modules the warm "
                                              "process imports, comma-separated (it always "
                                              "imports torch and numpy) [env E31_PRELOAD]"),
           as_json: bool = JsonOpt) -> None:
    """One pinned Celery worker per GPU (or group, or CPU slot); SIGTERM or --drain drains them."""
    from e31_worker.node.gpus import discover, parse_simulated, select
    from e31_worker.node.launcher import Launcher, default_host, plan_slots
    setup_logging(loglevel)
    settings = load_settings(home=home, isolation=isolation, preload=preload)
    if (drain or undrain) and not settings.redis_url:
        settings = _with_stack_redis(settings)
    if not settings.redis_url:
        fail("E31_REDIS_URL is not set: a worker needs the shared Redis", EXIT_INPUT)
    if drain and undrain:
        fail("--drain and --undrain: choose one", EXIT_INPUT)
    if drain:
        _drain(settings, nodes=node, host=hostname or default_host(), wait=wait, as_json=as_json)
        return
    if undrain:
        _undrain(settings, nodes=node, host=hostname or default_host(), as_json=as_json)
        return
    if settings.isolation == "sandbox":
        from e31_worker.attempt.sandbox import network_unavailable, sandbox_unavailable
        if (why := sandbox_unavailable(settings)) is not None:
            fail(f"cannot run jobs in a sandbox on this host: {why}. `--isolation process` "
                 "runs them as the worker's own user instead (docs/security.md)", EXIT_INPUT)
        if (why := network_unavailable(settings)) is not None:
            fail(f"cannot give jobs their own network on this host: {why}", EXIT_INPUT)
    try:
        found = parse_simulated(simulate_gpus) if simulate_gpus else discover()
        chosen = select(found, gpus) if found else []
        slots = plan_slots(chosen, cpu_slots=cpu_slots, spill=spill, group=group,
                           classes=settings.size_classes, host=hostname or default_host(),
                           gangs=group == 1 if gangs is None else gangs)
    except E31Error as exc:
        fail(exc.message, EXIT_INPUT)
    raise typer.Exit(Launcher(settings=settings, slots=slots, loglevel=loglevel,
                              keep_drains=keep_drains).run())


def _with_stack_redis(settings: Settings) -> Settings:
    """Without E31_REDIS_URL: the Redis of the `e31 up` running from this E31_HOME (its
    profile has the URL, which changes at every start), if one runs."""
    from e31.local.state import stack_redis_url
    url = stack_redis_url(settings.home)
    return settings.model_copy(update={"redis_url": url}) if url else settings


def _drain(settings: Settings, *, nodes: list[str], host: str, wait: bool, as_json: bool) -> None:
    """`e31 worker --drain`: ask the nodes (or every live node of `host`) to drain, and wait.
    The request is recorded in the store, which a worker checks before it obeys the Redis key
    (anyone with the broker's URL can write that); so this needs the store too."""
    from e31.edge import wiring
    from e31.ops.drain import live_nodes, request_drain, wait_drained
    r = wiring.redis_client(settings)
    targets = nodes or live_nodes(r, host=host)
    if not targets:
        fail(f"no live worker on host {host!r}: nothing to drain (see Flower, or pass --node)",
             EXIT_INPUT)
    repo = wiring.repo(settings)
    try:
        try:
            request_drain(r, repo, targets)
        except E31Error as exc:
            fail(f"cannot record the drain request in the store: {exc.message}",
                 EXIT_UNAVAILABLE)
        left: list[str] = []
        running: list[str] = []
        if wait:
            deadline = time.monotonic() + settings.kill_grace_s + DRAIN_EXTRA_S
            left = wait_drained(r, targets, timeout_s=settings.kill_grace_s + DRAIN_EXTRA_S)
            # A worker drops its heartbeat at once, and records its job `drained` (queued
            # again) only after the job stopped: "all drained" waits for the store to say so.
            running = _wait_jobs_off(repo, targets, deadline)
    finally:
        repo.engine.dispose()
    if as_json:
        print_json({"draining": targets, "still_live": left, "still_running": running,
                    "waited": wait})
    else:
        out.print(f"drain requested: {', '.join(targets)}")
        if left:
            out.print(f"still live: {', '.join(left)}")
        if running:
            out.print(f"still running there: {', '.join(running)}")
        if wait and not left and not running:
            out.print("all drained: no worker process and no running job left on them")
    if left or running:
        raise typer.Exit(1)


def _wait_jobs_off(repo: Repo, nodes: list[str], deadline: float) -> list[str]:
    """Wait until the store shows no `running` job leased by `nodes` (each recorded and queued
    again, or recovered), at most until `deadline`; returns those still running then."""
    while True:
        try:
            running = repo.jobs_running_on(nodes)
        except E31Error as exc:
            fail(f"cannot read the store: {exc.message}", EXIT_UNAVAILABLE)
        if not running or time.monotonic() >= deadline:
            return running
        time.sleep(DRAIN_POLL_S)


def _undrain(settings: Settings, *, nodes: list[str], host: str, as_json: bool) -> None:
    """`e31 worker --undrain`: forget the drain requests of `nodes` (or of every drained node
    of `host`), in Redis and in the store; a launcher that keeps drains starts them again."""
    import redis

    from e31.edge import wiring
    from e31.ops.drain import clear_drain
    repo = wiring.repo(settings)
    try:
        drained = [d.node for d in repo.drained_nodes()]
        targets = nodes or [n for n in drained if n.rpartition("@")[2] == host]
        if not targets:
            fail(f"no drained node on host {host!r}: nothing to undrain (`e31 queue` lists the "
                 "drained nodes; or pass --node)", EXIT_INPUT)
        try:
            clear_drain(wiring.redis_client(settings), targets)
        except redis.RedisError as exc:
            fail(f"cannot reach Redis: {exc}", EXIT_UNAVAILABLE)
        repo.clear_drain(targets)
    except E31Error as exc:
        fail(f"cannot clear the drain request in the store: {exc.message}", EXIT_UNAVAILABLE)
    finally:
        repo.engine.dispose()
    if as_json:
        print_json({"undrained": targets})
    else:
        out.print(f"undrained: {', '.join(targets)} (a launcher started with --keep-drains, as "
                  "`e31 up`'s is, starts them within seconds; otherwise start `e31 worker` again)")


@app.command()
def api(host: str | None = typer.Option(None, "--host", help="[env E31_API_HOST]"),
        port: int | None = typer.Option(None, "--port", help="[env E31_API_PORT]"),
        home: Path | None = HomeOpt) -> None:
    """Serve the HTTP API (OpenAPI at /docs)."""
    import uvicorn

    from e31.api import create_app
    setup_logging("INFO")
    settings = load_settings(home=home, api_host=host, api_port=port)
    if not settings.redis_url:
        fail("E31_REDIS_URL is not set: the API wakes the scheduler through Redis", EXIT_INPUT)
    uvicorn.run(create_app(settings), host=settings.api_host, port=settings.api_port,
                log_level="warning")


@app.command()
def scheduler(home: Path | None = HomeOpt) -> None:
    """Publish queued jobs into their class queues (one leader; a second one waits)."""
    from e31.edge import wiring
    from e31.scheduling.leader import REDIS_SOCKET_TIMEOUT_S, Scheduler
    setup_logging("INFO")
    settings = load_settings(home=home)
    if not settings.redis_url:
        fail("E31_REDIS_URL is not set", EXIT_INPUT)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    Scheduler(settings=settings, repo=wiring.scheduling_store(settings),
              redis_client=wiring.redis_client(settings, socket_timeout_s=REDIS_SOCKET_TIMEOUT_S),
              celery=wiring.celery(settings)).run(stop)


@app.command()
def flower(home: Path | None = HomeOpt) -> None:
    """Flower on the same broker and settings, with basic auth on every route (its /metrics and
    /healthcheck too), on a private address."""
    from e31.client.profile import read_profile
    from e31.edge import wiring
    from e31.edge.flowerauth import run
    settings = load_settings(home=home)
    password = settings.flower_password or read_profile(settings.home).get("flower_password")
    if not settings.redis_url or not password:
        fail("Flower needs E31_REDIS_URL and E31_FLOWER_PASSWORD", EXIT_INPUT)
    run(wiring.celery(settings), [f"--address={settings.flower_host}",
                                  f"--port={settings.flower_port}",
                                  f"--basic-auth={settings.flower_user}:{password}",
                                  "--persistent=False", "--purge_offline_workers=60"])


@db_app.command("upgrade")
def db_upgrade(home: Path | None = HomeOpt, as_json: bool = JsonOpt) -> None:
    """Create or migrate the store's schema to the newest revision."""
    from e31.edge import wiring
    from e31.store.migrate import upgrade
    settings = load_settings(home=home)
    engine = wiring.repo(settings).engine
    upgrade(engine)
    if not as_json:
        out.print(f"store at newest revision: {_redact(settings.resolved_database_url)}",
                  soft_wrap=True, highlight=False)   # a URL is never cut at the width
        return
    from alembic.runtime.migration import MigrationContext
    with engine.connect() as conn:
        revision = MigrationContext.configure(conn).get_current_revision()
    print_json({"database_url": _redact(settings.resolved_database_url), "revision": revision})


def _redact(url: str) -> str:
    """The database URL without its password, to print."""
    from sqlalchemy.engine import make_url
    return make_url(url).render_as_string(hide_password=True)
