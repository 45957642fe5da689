"""`e31 up` / `e31 down`: the whole stack on one machine, on embedded defaults.

Redis (E31_REDIS_URL, else a private redis-server), SQLite under E31_HOME, the API, the
scheduler, the workers and Flower, as child processes of `e31 up`, which stops them all on
Ctrl-C, SIGTERM or `e31 down`.

The private Redis requires a password that `e31 up` generates each time and keeps in
`E31_HOME/redis.password`; every process it starts gets it inside its `E31_REDIS_URL`, which a
job never sees (docs/security.md). The API's /metrics wants a token of its own: `e31 up` keeps
one in `E31_HOME/metrics.token` (made once, kept across restarts so a scraper's copy stays good)
and gives the API alone its path. E31_HOME is 0700; the password, the metrics token, the profile
and the SQLite store are 0600.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlsplit

import httpx
import redis
from sqlalchemy.engine import make_url

from e31.client.profile import read_profile, write_profile
from e31.core import keys
from e31.core.clock import utcnow
from e31.core.errors import ConfigError, Conflict
from e31.edge.secrets import generate_key
from e31.edge.settings import Settings
from e31.local.models import register_builtin_models
from e31.local.redisserver import start_redis
from e31.local.state import STATE_FILE, pid_alive
from e31.store import Repo, make_engine
from e31.store.migrate import upgrade

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 90.0        # API answering and every worker beating
STOP_TIMEOUT_S = 30.0         # per process, after SIGTERM (workers get kill_grace_s more)
DEFAULT_TENANT = "default"
REDIS_PASSWORD_FILE = "redis.password"  # under home, 0600: the private Redis's password
REDIS_PASSWORD_BYTES = 32     # of randomness, URL-safe base64: 43 characters
METRICS_TOKEN_FILE = "metrics.token"    # under home, 0600: what a scrape of /metrics sends
SECRETS_KEY_FILE = "secrets.key"        # under home, 0600: the Fernet key of tenants' secrets
PRIVATE_DIR_MODE = 0o700      # E31_HOME: the store, artifacts, logs and secrets are inside
PRIVATE_FILE_MODE = 0o600     # the store file, the profile, the Redis password


@dataclass
class Child:
    """One process of the stack, with the environment it starts with, the first time and
    every time `supervise` starts it again (the API's alone names the metrics token file)."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None


@dataclass
class LocalStack:
    settings: Settings
    worker_args: list[str]
    flower: bool = True
    children: list[Child] = field(default_factory=list)
    _redis_proc: subprocess.Popen[bytes] | None = None
    _redis_url: str = ""          # the private Redis's (with its password); "" for the user's
    _redis_pid: int | None = None  # the live private redis-server, ours or restarted by hand
    _stop: threading.Event = field(default_factory=threading.Event)

    @property
    def state_path(self) -> Path:
        return self.settings.home / STATE_FILE

    def start(self) -> dict[str, str]:
        """Start everything; returns the profile (url, token, flower address)."""
        home = self.settings.home
        make_private_home(home)
        (home / "logs").mkdir(exist_ok=True)
        _refuse_second_stack(self.state_path)
        redis_url = self.settings.redis_url  # the user's own Redis is used as it is
        if not redis_url:
            self._redis_proc, redis_url = start_redis(
                home / "redis", log_path=home / "logs" / "redis.log",
                password=new_redis_password(home))
            self._redis_url, self._redis_pid = redis_url, self._redis_proc.pid
        make_private_sqlite(self.settings.resolved_database_url)
        engine = make_engine(self.settings.resolved_database_url)
        upgrade(engine)
        repo = Repo(engine, half_life_s=self.settings.fair_share_half_life_s)
        profile = _ensure_profile(self.settings, repo, redis_url)
        register_builtin_models(self.settings, repo)
        env = dict(os.environ, E31_HOME=str(home), E31_REDIS_URL=redis_url,
                   E31_DATABASE_URL=self.settings.resolved_database_url,
                   E31_ARTIFACTS_URL=self.settings.resolved_artifacts_url,
                   E31_API_PORT=str(self.settings.api_port), E31_API_HOST=self.settings.api_host,
                   E31_FLOWER_HOST=self.settings.flower_host,
                   E31_FLOWER_PORT=str(self.settings.flower_port),
                   E31_FLOWER_USER=self.settings.flower_user,
                   E31_FLOWER_PASSWORD=profile["flower_password"])
        if not (self.settings.secrets_key or self.settings.secrets_key_file):
            env["E31_SECRETS_KEY_FILE"] = str(secrets_key_path(home))   # the API's, the worker's
        if self.flower:
            # Flower sees every job from the first, its `sent` state too (docs/operations.md)
            env.setdefault("E31_CELERY_EVENTS", "always")
        api_env = dict(env)
        if not (self.settings.metrics_token or self.settings.metrics_token_file):
            api_env["E31_METRICS_TOKEN_FILE"] = str(metrics_token_path(home))
        me = [sys.executable, "-m", "e31.cli"]
        self.children = [Child("api", me + ["api"], api_env),
                         Child("scheduler", me + ["scheduler"], env),
                         # --keep-drains: a drained node stays drained when `supervise`
                         # restarts the launcher, until `e31 worker --undrain`
                         Child("worker", me + ["worker", "--keep-drains", *self.worker_args],
                               env)]
        if self.flower:
            self.children.append(Child("flower", me + ["flower"], env))
        for child in self.children:
            self._spawn(child)
        self._write_state(ready=False, profile=profile)
        self._wait_ready(profile["url"], redis_url)
        self._write_state(ready=True, profile=profile)
        self._profile = profile
        return profile

    def _spawn(self, child: Child) -> None:
        """Start `child` with its own environment (a restart too: the API's keeps the metrics
        token file, which the others never get)."""
        out = open(self.settings.home / "logs" / f"{child.name}.log", "ab")
        child.proc = subprocess.Popen(child.argv, env=child.env, stdout=out,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def _wait_ready(self, url: str, redis_url: str) -> None:
        r = redis.Redis.from_url(redis_url)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            for child in self.children:
                if child.proc and child.proc.poll() is not None:
                    raise ConfigError(f"{child.name} exited with code {child.proc.returncode}; see "
                                      f"{self.settings.home / 'logs' / (child.name + '.log')}")
            try:
                api_ok = httpx.get(f"{url}/v1/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                api_ok = False
            if api_ok and any(True for _ in r.scan_iter(match=keys.worker_pattern())):
                return
            time.sleep(0.2)
        raise ConfigError(f"the stack was not ready within {READY_TIMEOUT_S:g} s; "
                          f"see the logs in {self.settings.home / 'logs'}")

    def _write_state(self, *, ready: bool, profile: dict[str, str]) -> None:
        children = {c.name: c.proc.pid for c in self.children if c.proc}
        if self._redis_pid:
            children["redis"] = self._redis_pid
        state = {"pid": os.getpid(), "ready": ready, "url": profile["url"],
                 "flower": profile.get("flower_url"), "children": children}
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        os.replace(tmp, self.state_path)

    def supervise(self) -> None:
        """Until asked to stop: restart a child that died (the API, the scheduler, the worker
        launcher, Flower) and the private Redis, and keep stack.json's pids the live ones."""
        while not self._stop.wait(1.0):
            changed = self._keep_redis()
            for child in self.children:
                if child.proc and child.proc.poll() is not None:
                    log.warning("%s exited with code %s; restarting", child.name,
                                child.proc.returncode)
                    self._spawn(child)
                    changed = True
            if changed:
                self._write_state(ready=True, profile=self._profile)

    def _keep_redis(self) -> bool:
        """Restart the private Redis if it died, on the same port with the same password (so
        every process's E31_REDIS_URL stays good; they reconnect, and the scheduler publishes
        again what the empty Redis lost). One restarted by hand there first is adopted.
        Returns whether its pid changed."""
        if not self._redis_url or self._redis_running():
            return False
        code = self._redis_proc.poll() if self._redis_proc else None
        adopted = _redis_server_pid(self._redis_url)
        if adopted is not None:
            log.warning("redis exited with code %s; another redis-server (pid %d) serves its "
                        "port with its password: adopted", code, adopted)
            self._redis_proc, self._redis_pid = None, adopted
            return True
        log.warning("redis exited with code %s; restarting on the same port", code)
        where = urlsplit(self._redis_url)
        try:
            self._redis_proc, _ = start_redis(
                self.settings.home / "redis", port=where.port,
                log_path=self.settings.home / "logs" / "redis.log",
                password=unquote(where.password) if where.password else None)
        except ConfigError as exc:
            log.warning("redis_restart_failed: %s; trying again", exc)
            self._redis_proc, self._redis_pid = None, None
            return True
        self._redis_pid = self._redis_proc.pid
        return True

    def _redis_running(self) -> bool:
        if self._redis_proc is not None:
            return self._redis_proc.poll() is None
        return self._redis_pid is not None and pid_alive(self._redis_pid)

    def request_stop(self) -> None:
        self._stop.set()

    def stop(self) -> None:
        """Workers first (they drain running jobs), then Flower, the scheduler and the API
        together (none needs another to stop first: stopped one after the other they made
        `e31 down` wait for each in turn), then Redis."""
        self._terminate({"worker"}, STOP_TIMEOUT_S + self.settings.kill_grace_s + 15)
        self._terminate({"flower", "scheduler", "api"}, STOP_TIMEOUT_S)
        if self._redis_proc is not None:
            self._redis_proc.terminate()
            _wait_or_kill(self._redis_proc, STOP_TIMEOUT_S)
        if self._redis_url:
            _shutdown_redis(self._redis_url)   # one restarted by hand on its port, if any
        self.state_path.unlink(missing_ok=True)

    def _terminate(self, names: set[str], timeout_s: float) -> None:
        """SIGTERM every live child named in `names` at once, then wait for each (killed after
        `timeout_s`)."""
        live = [c.proc for c in self.children
                if c.name in names and c.proc and c.proc.poll() is None]
        for proc in live:
            proc.send_signal(signal.SIGTERM)
        for proc in live:
            _wait_or_kill(proc, timeout_s)


def _redis_server_pid(url: str) -> int | None:
    """The pid of the redis-server that answers `url` (with its password), or None."""
    client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
    try:
        return int(client.info("server")["process_id"])
    except (redis.RedisError, KeyError, ValueError):
        return None
    finally:
        client.close()


def _shutdown_redis(url: str) -> None:
    """Stop the redis-server answering `url`, if one does: only one that knows the private
    password can, so it is the stack's (restarted by hand, say), never someone else's."""
    pid = _redis_server_pid(url)
    if pid is None:
        return
    client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
    try:
        client.shutdown(nosave=True)
    except redis.RedisError:
        pass   # it closes the connection as it exits
    finally:
        client.close()
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)


def _wait_or_kill(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _refuse_second_stack(state_path: Path) -> None:
    try:
        pid = int(json.loads(state_path.read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return
    if pid_alive(pid):
        raise ConfigError(f"a stack is already running from this home (pid {pid}); "
                          f"`e31 down` stops it, or pass --home for another")


def make_private_home(home: Path) -> None:
    """Create E31_HOME readable by its owner only (mode 0700), or make it so."""
    home.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
    os.chmod(home, PRIVATE_DIR_MODE)


def new_redis_password(home: Path) -> str:
    """A fresh password for the private Redis, written to E31_HOME/redis.password with mode
    0600 (created so, never widened by the umask) before anything else can read it."""
    password = secrets.token_urlsafe(REDIS_PASSWORD_BYTES)
    _write_secret(home / REDIS_PASSWORD_FILE, password)
    return password


def metrics_token_path(home: Path) -> Path:
    """E31_HOME/metrics.token, holding the token a scrape of the API's /metrics must send:
    made (mode 0600) when missing or empty, kept otherwise."""
    path = home / METRICS_TOKEN_FILE
    try:
        if path.read_text().strip():
            return path
    except FileNotFoundError:
        pass
    _write_secret(path, secrets.token_urlsafe(REDIS_PASSWORD_BYTES))
    return path


def secrets_key_path(home: Path) -> Path:
    """E31_HOME/secrets.key, holding the Fernet key of tenants' secrets: made (mode 0600) on
    the first start, kept afterwards (a new key would leave every stored secret unreadable)."""
    path = home / SECRETS_KEY_FILE
    try:
        if path.read_text().strip():
            return path
    except FileNotFoundError:
        pass
    _write_secret(path, generate_key())
    return path


def _write_secret(path: Path, value: str) -> None:
    """Write `value` to `path` with mode 0600 (created so, never widened by the umask) under a
    temporary name first, so no reader ever sees it half written or open to others."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, PRIVATE_FILE_MODE)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    os.replace(tmp, path)


def make_private_sqlite(database_url: str) -> None:
    """Create a SQLite store file with mode 0600 before the engine opens it (SQLite gives its
    -wal and -shm files the same mode), or make an existing one so; other stores: nothing."""
    url = make_url(database_url)
    if not url.drivername.startswith("sqlite") or not url.database or url.database == ":memory:":
        return
    path = Path(url.database)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, PRIVATE_FILE_MODE))
    for file in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        if file.exists():
            os.chmod(file, PRIVATE_FILE_MODE)


def _ensure_profile(settings: Settings, repo: Repo, redis_url: str) -> dict[str, str]:
    """The local profile: API address, a token of the `default` tenant, Flower's login."""
    old = read_profile(settings.home)
    token = old.get("token")
    if not token or repo.tenant_for_token(token) is None:
        try:
            _, token = repo.create_tenant(DEFAULT_TENANT, admin=True, now=utcnow())
        except Conflict:
            token = repo.create_token(DEFAULT_TENANT, now=utcnow())
    password = settings.flower_password or old.get("flower_password") or secrets.token_urlsafe(12)
    profile = {"url": f"http://{settings.api_host}:{settings.api_port}", "token": token,
               "tenant": old.get("tenant", DEFAULT_TENANT), "redis_url": redis_url,
               "flower_url": f"http://{settings.flower_host}:{settings.flower_port}",
               "flower_user": settings.flower_user, "flower_password": password}
    write_profile(settings.home, profile)
    return profile
