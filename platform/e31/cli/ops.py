"""Operator commands of `e31`: up, down, worker, api, scheduler, flower, db, tenant."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import typer

from e31.errors import ConfigError, Conflict, E31Error, NotFound, SpecError

EXIT_INPUT = 2
DETACH_READY_TIMEOUT_S = 120.0
DRAIN_EXTRA_S = 60.0        # beyond the kill grace: a job's checkpoint upload and the record


def _settings(**overrides: Any) -> Any:
    from e31.settings import Settings
    return Settings.load(overrides)


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), force=True,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


def _worker_argv(gpus: str, cpu_slots: int, simulate_gpus: str | None, spill: bool,
                 group: int, hostname: str | None) -> list[str]:
    argv = ["--gpus", gpus, "--cpu-slots", str(cpu_slots), "--group", str(group),
            "--spill" if spill else "--no-spill"]
    if simulate_gpus:
        argv += ["--simulate-gpus", simulate_gpus]
    if hostname:
        argv += ["--hostname", hostname]
    return argv


def register_ops(app: typer.Typer, db_app: typer.Typer, tenant_app: typer.Typer) -> None:
    from e31.cli.jobs import HomeOpt, JsonOpt, _fail, _print_json, err, out

    gpus_opt = typer.Option("all", "--gpus", help="GPUs to serve: all, 0,1 or 0-3")
    cpu_opt = typer.Option(0, "--cpu-slots", help="worker processes for the cpu class")
    sim_opt = typer.Option(None, "--simulate-gpus", help="pretend GPUs, e.g. 2x24,1x80 (no GPU needed)")
    spill_opt = typer.Option(True, "--spill/--no-spill", help="also take smaller GPU classes")
    group_opt = typer.Option(1, "--group", help="GPUs per worker process, for multi-GPU jobs")
    host_opt = typer.Option(None, "--hostname", help="node-name suffix (default: this host's name)")

    @app.command()
    def worker(gpus: str = gpus_opt, cpu_slots: int = cpu_opt, simulate_gpus: str | None = sim_opt,
               spill: bool = spill_opt, group: int = group_opt, hostname: str | None = host_opt,
               home: Path | None = HomeOpt, loglevel: str = typer.Option("INFO", "--loglevel"),
               drain: bool = typer.Option(False, "--drain", help="drain the live workers of this "
                                          "host (or --hostname, or --node) instead of starting any"),
               node: list[str] = typer.Option([], "--node", help="with --drain: a node name, e.g. gpu0@host"),
               wait: bool = typer.Option(True, "--wait/--no-wait", help="with --drain: wait until they stopped"),
               as_json: bool = JsonOpt) -> None:
        """One pinned Celery worker per GPU (or group, or CPU slot); SIGTERM or --drain drains them."""
        from e31_worker.node.gpus import discover, parse_simulated, select
        from e31_worker.node.launcher import Launcher, default_host, plan_slots
        _logging(loglevel)
        settings = _settings(home=home)
        if not settings.redis_url:
            _fail("E31_REDIS_URL is not set: a worker needs the shared Redis", EXIT_INPUT)
        if drain:
            _drain(settings, nodes=node, host=hostname or default_host(), wait=wait, as_json=as_json)
            return
        try:
            found = parse_simulated(simulate_gpus) if simulate_gpus else discover()
            chosen = select(found, gpus) if found else []
            slots = plan_slots(chosen, cpu_slots=cpu_slots, spill=spill, group=group,
                               classes=settings.size_classes, host=hostname or default_host())
        except E31Error as exc:
            _fail(exc.message, EXIT_INPUT)
        raise typer.Exit(Launcher(settings=settings, slots=slots, loglevel=loglevel).run())

    def _drain(settings: Any, *, nodes: list[str], host: str, wait: bool, as_json: bool) -> None:
        import redis

        from e31.drain import live_nodes, request_drain, wait_drained
        r = redis.Redis.from_url(settings.redis_url)
        targets = nodes or live_nodes(r, host=host)
        if not targets:
            _fail(f"no live worker on host {host!r}: nothing to drain (see Flower, or pass --node)",
                  EXIT_INPUT)
        request_drain(r, targets)
        left = wait_drained(r, targets, timeout_s=settings.kill_grace_s + DRAIN_EXTRA_S) if wait else []
        if as_json:
            _print_json({"draining": targets, "still_live": left, "waited": wait})
        else:
            out.print(f"drain requested: {', '.join(targets)}")
            if wait:
                out.print("all drained" if not left else f"still live: {', '.join(left)}")
        if left:
            raise typer.Exit(1)

    @app.command()
    def api(host: str | None = typer.Option(None, "--host", help="[env E31_API_HOST]"),
            port: int | None = typer.Option(None, "--port", help="[env E31_API_PORT]"),
            home: Path | None = HomeOpt) -> None:
        """Serve the HTTP API (OpenAPI at /docs)."""
        import uvicorn

        from e31.api import create_app
        _logging("INFO")
        settings = _settings(home=home, api_host=host, api_port=port)
        if not settings.redis_url:
            _fail("E31_REDIS_URL is not set: the API wakes the scheduler through Redis", EXIT_INPUT)
        uvicorn.run(create_app(settings), host=settings.api_host, port=settings.api_port,
                    log_level="warning")

    @app.command()
    def scheduler(home: Path | None = HomeOpt) -> None:
        """Publish queued jobs into their class queues (one leader; a second one waits)."""
        import redis

        from e31.celeryapp import make_celery
        from e31.scheduling.leader import REDIS_SOCKET_TIMEOUT_S, Scheduler
        from e31.store import Repo, make_engine
        _logging("INFO")
        settings = _settings(home=home)
        if not settings.redis_url:
            _fail("E31_REDIS_URL is not set", EXIT_INPUT)
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        Scheduler(settings=settings, repo=Repo(make_engine(settings.resolved_database_url),
                                                half_life_s=settings.fair_share_half_life_s),
                  redis_client=redis.Redis.from_url(settings.redis_url,
                                                    socket_timeout=REDIS_SOCKET_TIMEOUT_S),
                  celery=make_celery(settings)).run(stop)

    @app.command()
    def flower(home: Path | None = HomeOpt) -> None:
        """Flower on the same broker and settings, with basic auth, on a private address."""
        from e31.celeryapp import make_celery
        from e31.client.profile import read_profile
        settings = _settings(home=home)
        password = settings.flower_password or read_profile(settings.home).get("flower_password")
        if not settings.redis_url or not password:
            _fail("Flower needs E31_REDIS_URL and E31_FLOWER_PASSWORD", EXIT_INPUT)
        make_celery(settings).start(["flower", f"--address={settings.flower_host}",
                                     f"--port={settings.flower_port}",
                                     f"--basic-auth={settings.flower_user}:{password}",
                                     "--persistent=False", "--purge_offline_workers=60"])

    @db_app.command("upgrade")
    def db_upgrade(home: Path | None = HomeOpt) -> None:
        """Create or migrate the store's schema to the newest revision."""
        from e31.store import make_engine
        from e31.store.migrate import upgrade
        settings = _settings(home=home)
        upgrade(make_engine(settings.resolved_database_url))
        out.print(f"store at newest revision: {_redact(settings.resolved_database_url)}")

    weight_opt = typer.Option(None, "--weight", help="fair-share weight (default 1): a tenant "
                              "of weight 2 gets twice the GPU time of one of weight 1 under contention")
    quota_opt = typer.Option([], "--quota", help="CLASS=N: at most N GPUs of the class at once "
                             "(repeat for several classes)")

    @tenant_app.command("create")
    def tenant_create(name: str, admin: bool = typer.Option(False, "--admin", help="may read every tenant's usage"),
                      weight: float | None = weight_opt, quota: list[str] = quota_opt,
                      home: Path | None = HomeOpt, as_json: bool = JsonOpt) -> None:
        """Create a tenant; its token is printed once (only its hash is stored)."""
        from e31.clock import utcnow
        from e31.store import Repo, make_engine
        from e31.store.migrate import upgrade
        settings = _settings(home=home)
        quotas = _quotas(quota, settings)
        engine = make_engine(settings.resolved_database_url)
        upgrade(engine)
        try:
            tenant, token = Repo(engine).create_tenant(name, admin=admin, now=utcnow(),
                                                       weight=1.0 if weight is None else weight,
                                                       quotas=quotas)
        except (Conflict, SpecError) as exc:
            _fail(exc.message, EXIT_INPUT)
        if as_json:
            _print_json({**tenant.to_dict(), "token": token})
        else:
            out.print(f"tenant {tenant.name} created (weight {tenant.weight:g}"
                      f"{_quota_text(tenant.quotas)}); its token (shown once):\n{token}")

    @tenant_app.command("update")
    def tenant_update(name: str, weight: float | None = weight_opt, quota: list[str] = quota_opt,
                      no_quota: list[str] = typer.Option([], "--no-quota", help="CLASS: drop the "
                                                         "quota of the class (repeatable)"),
                      home: Path | None = HomeOpt, as_json: bool = JsonOpt) -> None:
        """Change a tenant's weight or quotas; the scheduler uses them from its next tick."""
        from e31.store import Repo, make_engine
        from e31.store.migrate import upgrade
        settings = _settings(home=home)
        quotas = _quotas(quota, settings)
        if weight is None and not quotas and not no_quota:
            _fail("nothing to change: give --weight, --quota or --no-quota", EXIT_INPUT)
        engine = make_engine(settings.resolved_database_url)
        upgrade(engine)
        try:
            tenant = Repo(engine).update_tenant(name, weight=weight, quotas=quotas,
                                                drop_quotas=no_quota)
        except (NotFound, SpecError) as exc:
            _fail(exc.message, EXIT_INPUT)
        if as_json:
            _print_json(tenant.to_dict())
        else:
            out.print(f"tenant {tenant.name}: weight {tenant.weight:g}{_quota_text(tenant.quotas)}")

    def _quotas(items: list[str], settings: Any) -> dict[str, int]:
        from e31.store.tenants import check_quotas
        raw: dict[str, Any] = {}
        for item in items:
            cls, sep, n = item.partition("=")
            if not sep or not cls or not n.strip().isdigit():
                _fail(f"--quota {item!r}: expected CLASS=N, e.g. gpu80=8", EXIT_INPUT)
            raw[cls] = int(n)
        try:
            return check_quotas(raw, [c.name for c in settings.size_classes])
        except SpecError as exc:
            _fail(exc.message, EXIT_INPUT)

    @app.command()
    def up(gpus: str = gpus_opt, cpu_slots: int | None = typer.Option(None, "--cpu-slots",
           help="cpu-class workers (default: 1, or 2 without GPUs)"),
           simulate_gpus: str | None = sim_opt, spill: bool = spill_opt, group: int = group_opt,
           home: Path | None = HomeOpt, port: int | None = typer.Option(None, "--port", help="API port [env E31_API_PORT]"),
           flower_port: int | None = typer.Option(None, "--flower-port"),
           no_flower: bool = typer.Option(False, "--no-flower"),
           detach: bool = typer.Option(False, "--detach", "-d", help="return once ready; `e31 down` stops it")) -> None:
        """Start the whole stack on this machine: Redis, store, API, scheduler, workers, Flower."""
        from e31.local.stack import LocalStack
        settings = _settings(home=home, api_port=port, flower_port=flower_port)
        if detach:
            _detach(settings.home, err, out)
            return
        from e31_worker.node.gpus import discover
        real = [] if simulate_gpus else discover()
        slots = cpu_slots if cpu_slots is not None else (1 if (real or simulate_gpus) else 2)
        if not real and not simulate_gpus:
            err.print("no GPU found: serving the cpu class only (add --simulate-gpus 1x24 to try GPU routing)")
        stack = LocalStack(settings=settings, flower=not no_flower,
                           worker_args=_worker_argv(gpus, slots, simulate_gpus, spill, group, None))
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stack.request_stop())
        try:
            profile = stack.start()
            flower_line = (f"Flower {profile['flower_url']} (user {profile['flower_user']}, "
                           f"password in {settings.profile_path})") if not no_flower else "Flower off"
            print(f"E31 Batch is ready: API {profile['url']}, {flower_line}. "
                  f"Ctrl-C or `e31 down` stops it.")
            sys.stdout.flush()
            stack.supervise()
        except E31Error as exc:
            err.print(f"error: {exc.message}")
            stack.stop()
            raise typer.Exit(EXIT_INPUT if isinstance(exc, ConfigError) else 3)
        stack.stop()
        out.print("E31 Batch stopped.")

    @app.command()
    def down(home: Path | None = HomeOpt) -> None:
        """Stop the stack `e31 up` started from this home (running jobs are drained)."""
        from e31.local.stack import stop_stack
        settings = _settings(home=home)
        if stop_stack(settings.home):
            out.print("E31 Batch stopped.")
        else:
            out.print(f"no running stack in {settings.home}")


def _detach(home: Path, err: Any, out: Any) -> None:
    """Run `e31 up` (without -d) in the background and return when it is ready."""
    from e31.local.stack import STATE_FILE, stack_ready
    argv = [a for a in sys.argv[1:] if a not in ("-d", "--detach")]
    home.mkdir(parents=True, exist_ok=True)
    (home / "logs").mkdir(exist_ok=True)
    log_path = home / "logs" / "up.log"
    (home / STATE_FILE).unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "e31.cli", *argv], env=dict(os.environ, E31_HOME=str(home)),
                            stdout=open(log_path, "ab"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + DETACH_READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err.print(f"error: e31 up exited with code {proc.returncode}; see {log_path}")
            raise typer.Exit(proc.returncode or 3)
        if stack_ready(home):
            lines = log_path.read_text().strip().splitlines()
            print(next((line for line in reversed(lines) if "is ready" in line),
                       "E31 Batch is ready."))
            return
        time.sleep(0.3)
    err.print(f"error: the stack was not ready in {DETACH_READY_TIMEOUT_S:g} s; see {log_path}")
    raise typer.Exit(3)


def _quota_text(quotas: dict[str, int]) -> str:
    return (", quotas " + ", ".join(f"{c}={n}" for c, n in sorted(quotas.items()))) if quotas else ""


def _redact(url: str) -> str:
    from sqlalchemy.engine import make_url
    return make_url(url).render_as_string(hide_password=True)
