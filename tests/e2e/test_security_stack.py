"""No way in through the data, against a real `e31 up` stack: its Redis refuses a client
without the password, no job sees that password, its files are private, and a link a job
leaves is never served.

Each test also shows that it would catch the hole: the same check, run where the protection
is absent (a Redis without a password, a file made the ordinary way, the worker's own
environment, the API process's environment), finds what the attack was after.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import unquote, urlsplit

import httpx
import redis
import yaml

from e31.core import keys
from e31.local.redisserver import find_redis_server, free_port, start_redis
from tests.conftest import wait_for

from .conftest import Stack

WAIT_S = 60
COMPOSE = Path(__file__).parents[2] / "docker-compose.yml"


def stack_password(stack: Stack) -> str:
    password = urlsplit(stack.redis_url).password
    assert password, "the stack's Redis URL carries no password"
    return unquote(password)


def child_pid(stack: Stack, name: str) -> int:
    return int(json.loads((stack.home / "stack.json").read_text())["children"][name])


def environ_of(pid: int) -> bytes:
    return Path(f"/proc/{pid}/environ").read_bytes()


def anonymous_answer(port: int, command: bytes) -> bytes:
    """What Redis on 127.0.0.1:`port` answers a client that never authenticated (raw RESP,
    so no client library sends anything first)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(command)
        return conn.recv(4096)


def resp(*words: str) -> bytes:
    return b"".join([f"*{len(words)}\r\n".encode()]
                    + [f"${len(w)}\r\n{w}\r\n".encode() for w in words])


# -- the broker ---------------------------------------------------------------------------


def test_the_stacks_redis_refuses_a_client_without_the_password(stack: Stack,
                                                                tmp_path: Path) -> None:
    # Given the stack's private Redis
    port = urlsplit(stack.redis_url).port
    assert port is not None
    worker_node = next(iter(redis.Redis.from_url(stack.redis_url).scan_iter(
        match=keys.worker_pattern()))).decode().removeprefix(keys.WORKER_PREFIX)

    # When a client without the password pings it, drains a worker, or publishes to a queue
    attacks = [resp("PING"), resp("SET", keys.drain(worker_node), "1"),
               resp("LPUSH", "e31.cpu", "{}")]
    answers = [anonymous_answer(port, a) for a in attacks]

    # Then every one is refused, and nothing was written; with the password it answers
    assert all(a.startswith(b"-NOAUTH") for a in answers), answers
    authed = redis.Redis.from_url(stack.redis_url)
    assert authed.ping() and authed.get(keys.drain(worker_node)) is None

    # And the same attacks get in where Redis has no password (the stack before the fix)
    proc, open_url = start_redis(tmp_path / "open-redis")
    try:
        open_port = int(urlsplit(open_url).port or 0)
        assert anonymous_answer(open_port, resp("PING")) == b"+PONG\r\n"
        assert anonymous_answer(open_port, resp("SET", keys.drain(worker_node), "1")) == b"+OK\r\n"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_the_password_is_in_home_with_mode_0600_and_on_no_command_line(stack: Stack) -> None:
    password = stack_password(stack)
    path = stack.home / "redis.password"
    assert path.read_text().strip() == password
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    # `ps` shows every process's command line to every user of the host
    for name in ("redis", "api", "scheduler", "worker"):
        cmdline = Path(f"/proc/{child_pid(stack, name)}/cmdline").read_bytes()
        assert password.encode() not in cmdline, name


def test_every_process_of_the_stack_uses_the_password_and_no_job_sees_it(stack: Stack) -> None:
    # Given the stack's processes: each one's Redis URL carries the password (that is how
    # they all reach the broker that refuses anyone else)
    password = stack_password(stack).encode()
    for name in ("api", "scheduler", "worker"):
        assert password in environ_of(child_pid(stack, name)), name

    # When a job prints its whole environment, as its own process sees it
    job = stack.client().submit(command=["sh", "-c", "env; tr '\\0' '\\n' < /proc/self/environ"],
                                resources={"gpus": 0}, name="print-env")
    job.wait(timeout=WAIT_S)
    log = job.logs()

    # Then neither the password nor any URL of the platform is in it
    assert "PATH=" in log  # it did print its environment
    assert password.decode() not in log
    assert "E31_REDIS_URL" not in log and "E31_DATABASE_URL" not in log


def test_the_password_is_in_no_log_of_the_stack(stack: Stack) -> None:
    password = stack_password(stack).encode()
    logs = sorted((stack.home / "logs").glob("*.log"))
    assert logs
    for path in logs:
        assert password not in path.read_bytes(), path


def test_the_compose_redis_refuses_a_client_without_the_secret(tmp_path: Path) -> None:
    # Given the Redis service's own script from docker-compose.yml, run on this machine with
    # the secret file here and this machine's redis-server
    redis_service = yaml.safe_load(COMPOSE.read_text())["services"]["redis"]
    script = (redis_service["entrypoint"][-1].replace("$$", "$")
              .replace("docker-entrypoint.sh redis-server", find_redis_server())
              .replace(" <<EOF", " --save '' --appendonly no --port \"$PORT\" <<EOF"))

    @contextmanager
    def serve(secret: str) -> Iterator[int]:
        path = tmp_path / "redis_password"
        path.write_text(secret)
        port = free_port()
        proc = subprocess.Popen(["sh", "-c", script.replace("/run/secrets/redis_password",
                                                            str(path))],
                                env=dict(os.environ, PORT=str(port)), cwd=tmp_path,
                                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: _listening(port), timeout_s=15, what="the compose Redis")
            yield port
        finally:
            proc.terminate()
            proc.wait(timeout=10)

    # When a client without the password asks it, and one with it
    with serve("0f1e2d3c4b5a\n") as port:
        refused = anonymous_answer(port, resp("PING"))
        authed = redis.Redis(port=port, password="0f1e2d3c4b5a").ping()
    # Then it refuses the first and answers the second
    assert refused.startswith(b"-NOAUTH") and authed

    # And an empty secret (no password) would let the same client in: the check catches it
    with serve("") as port:
        assert anonymous_answer(port, resp("PING")) == b"+PONG\r\n"


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


# -- files and permissions ----------------------------------------------------------------


def private(path: Path, mode: int) -> bool:
    """Whether `path` has exactly `mode`: nobody but its owner may read it."""
    return stat.S_IMODE(path.stat().st_mode) == mode


def test_home_is_0700_and_the_store_the_profile_and_the_password_are_0600(
        stack: Stack, tmp_path: Path) -> None:
    home = stack.home
    assert private(home, 0o700)
    for name in ("e31.db", "profile.json", "redis.password"):
        assert private(home / name, 0o600), name
    for extra in ("e31.db-wal", "e31.db-shm"):  # SQLite gives them the store's mode
        if (home / extra).exists():
            assert private(home / extra, 0o600), extra

    # The same check finds a file made the ordinary way (umask 022): world-readable
    old = os.umask(0o022)
    try:
        (tmp_path / "ordinary.db").write_text("")
    finally:
        os.umask(old)
    assert not private(tmp_path / "ordinary.db", 0o600)


# -- links --------------------------------------------------------------------------------


def test_a_jobs_link_to_the_api_environment_is_refused_and_never_served(stack: Stack) -> None:
    # Given a job that leaves a link to /proc/self/environ among its outputs, beside a file
    job = stack.client().submit(
        command=["sh", "-c", 'cd "$E31_OUTPUT_DIR" && echo ok > ok.txt && '
                 "ln -s /proc/self/environ api-environ"],
        resources={"gpus": 0}, name="link-out")
    status = job.wait(timeout=WAIT_S)

    # When its owner lists and downloads its outputs through the stack's API
    headers = {"Authorization": f"Bearer {stack.token}"}
    listed = httpx.get(f"{stack.url}/v1/jobs/{job.id}/outputs", headers=headers).json()
    link = httpx.get(f"{stack.url}/v1/jobs/{job.id}/outputs/api-environ", headers=headers)

    # Then only the file is there, the link answers 404, and the attempt's log says why
    assert status["state"] == "succeeded"
    assert [o["path"] for o in listed["outputs"]] == ["ok.txt"]
    assert link.status_code == 404 and b"PATH=" not in link.content
    assert "output refused: api-environ: symbolic link" in job.logs()


def test_a_link_planted_in_the_file_store_is_answered_404_by_the_api(stack: Stack) -> None:
    # Given a finished job, and a link to /proc/self/environ planted among its stored outputs
    # (a job on the same machine can write into the file:// store)
    job = stack.client().submit(command=["sh", "-c", 'echo ok > "$E31_OUTPUT_DIR/ok.txt"'],
                                resources={"gpus": 0}, name="planted")
    job.wait(timeout=WAIT_S)
    [outputs] = list((stack.home / "artifacts").glob(f"*/{job.id}/outputs"))
    (outputs / "api-environ").symlink_to("/proc/self/environ")

    # When the owner downloads it through the API
    headers = {"Authorization": f"Bearer {stack.token}"}
    got = httpx.get(f"{stack.url}/v1/jobs/{job.id}/outputs/api-environ", headers=headers)

    # Then the API answers 404, never its own environment, which holds the Redis password
    assert got.status_code == 404
    password = stack_password(stack).encode()
    assert password not in got.content
    assert password in environ_of(child_pid(stack, "api"))  # what the attack was after

