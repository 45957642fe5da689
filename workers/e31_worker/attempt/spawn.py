"""Cold children forked by a small process, not by the worker (`e31_worker.child.spawner`).

`Spawner` owns the worker process's spawner: it starts it on the first cold start, asks it
for each cold child (`spawn`: the argv, environment, cwd, cgroups and the sandbox's `enter`
in its JSON form), and replaces it when it died or answered garbage; that attempt then
starts with `subprocess.Popen` as before, and after `MAX_FAILURES` in a row every cold
start does, said once in the log. Why: a `Popen` with a `preexec_fn` is a full fork of the
worker process (2.6 ms of its CPU, 6 ms with the GIL held, on this project's 2-core host:
`bench/cold_fork.py`); through the spawner, 0.3 ms of the worker's and 0.9 of the spawner's.

`PipedChild` is what the supervisor holds of a child the worker did not fork, the spawner's
or a warm process's (`e31_worker.attempt.warm.WarmChild`), in place of a `Popen`: its pid
(the attempt's process group), `poll` / `wait` through a pidfd, its exit status from the
status pipe its parent writes, and `stdout`, the read end of its log pipe.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import IO, Any

from e31_worker.attempt.jobenv import inherited_env

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 30.0    # the spawner imports the standard library only
ANSWER_TIMEOUT_S = 90.0   # the child's setup (its network: slirp4netns) before its exec
MAX_FAILURES = 3          # the spawner failed to start or answer this often in a row: stop
MESSAGE_MAX_BYTES = 1 << 16
SIGKILL_STATUS = -signal.SIGKILL


class PipedChild:
    """A child the worker did not fork, as the supervisor drives it: a `Popen`'s pid, poll,
    wait, returncode and stdout, over a pidfd and the status pipe."""

    def __init__(self, pid: int, pidfd: int, log_r: int, status_r: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.stdout: IO[bytes] = os.fdopen(log_r, "rb", buffering=0)
        self._pidfd = pidfd
        self._status = status_r
        self._lines: list[str] = []
        self._partial = ""
        self._eof = False

    def poll(self) -> int | None:
        if self.returncode is None and _readable(self._pidfd, 0):
            self._finish()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not _readable(self._pidfd, timeout):
                raise subprocess.TimeoutExpired(f"child {self.pid}", timeout or 0.0)
            self._finish()
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        """SIGKILL the child (its group and namespace take the rest with it)."""
        if self.returncode is None:
            try:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            except (ProcessLookupError, OSError):
                pass

    def close(self) -> None:
        for fd in (self._pidfd, self._status):
            try:
                os.close(fd)
            except OSError:
                pass
        self.stdout.close()

    def _finish(self) -> None:
        """The child ended: its status line says how; none means it was killed."""
        while not self._eof and self._read_status(0.5):
            pass
        code = SIGKILL_STATUS
        for line in self._lines:
            if line.startswith("X") and line[1:].lstrip("-").isdigit():
                code = int(line[1:])
        self.returncode = code
        for fd in (self._pidfd, self._status):
            try:
                os.close(fd)
            except OSError:
                pass
        self._pidfd = self._status = -1

    def _read_status(self, timeout_s: float) -> bool:
        """Read what the status pipe holds; False when nothing came in `timeout_s`."""
        if self._status < 0 or not _readable(self._status, timeout_s):
            return False
        chunk = os.read(self._status, 4096)
        if not chunk:
            self._eof = True
            return True
        text = self._partial + chunk.decode(errors="replace")
        *lines, self._partial = text.split("\n")
        self._lines += lines
        return True


class Spawner:
    """The worker process's spawner: started on first use, asked for cold children,
    replaced when broken, given up on after MAX_FAILURES in a row."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self._env = inherited_env(env if env is not None else os.environ)
        self._lock = threading.Lock()     # one request at a time
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._failures = 0
        self._closed = False
        self.disabled_because: str | None = None

    @property
    def pid(self) -> int | None:
        """The running spawner's pid, else None."""
        return self._proc.pid if self._proc is not None else None

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], *, cwd: str,
              cgroup_procs: Sequence[str] = (),
              enter: Mapping[str, Any] | None = None) -> PipedChild | None:
        """The started child, or None when there is no spawner (start it with `Popen`).
        Raises what `Popen` would: OSError when the program cannot be run or its cwd
        entered, ValueError for a NUL in an argument, SubprocessError when its setup (the
        cgroups, the sandbox's `enter`) failed."""
        if any("\0" in s for s in (*argv, *env, *env.values(), cwd)):
            raise ValueError("embedded null byte")
        request = json.dumps({"argv": list(argv), "env": dict(env), "cwd": cwd,
                              "cgroup_procs": list(cgroup_procs),
                              "enter": dict(enter) if enter is not None else None}).encode()
        with self._lock:
            sock = self._ready()
            if sock is None:
                return None
            log_r, log_w = os.pipe()
            status_r, status_w = os.pipe()
            try:
                socket.send_fds(sock, [request], [log_w, status_w])
                msg, fds, _, _ = socket.recv_fds(sock, MESSAGE_MAX_BYTES, 1)
                answer = json.loads(msg)
                if not isinstance(answer, dict):
                    raise ValueError(f"unexpected answer {msg[:200]!r}")
            except (OSError, ValueError) as exc:
                for fd in (log_r, status_r):
                    os.close(fd)
                self._broken(f"did not answer ({exc})" if isinstance(exc, OSError)
                             else f"answered garbage ({exc})")
                return None
            finally:
                os.close(log_w)
                os.close(status_w)
            self._failures = 0
        if isinstance(answer.get("pid"), int) and len(fds) == 1:
            return PipedChild(answer["pid"], fds[0], log_r, status_r)
        for fd in (*fds, log_r, status_r):
            os.close(fd)
        _raise(answer)
        return None   # an answer of neither kind: start it with Popen

    def close(self) -> None:
        """Stop the spawner; the children it started end with it."""
        with self._lock:
            self._closed = True
            self._stop()

    def _ready(self) -> socket.socket | None:
        """The spawner's socket, started now if it is not running (under the lock)."""
        if self._closed or self.disabled_because is not None:
            return None
        if self._proc is not None and self._proc.poll() is None and self._sock is not None:
            return self._sock
        self._stop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "e31_worker.child.spawner",
                 "--socket-fd", str(theirs.fileno())],
                env=self._env, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                start_new_session=True)
        except OSError as exc:
            ours.close()
            self._broken(f"did not start ({exc})")
            return None
        finally:
            theirs.close()
        self._proc, self._sock = proc, ours
        ours.settimeout(READY_TIMEOUT_S)
        try:
            ready = json.loads(ours.recv(MESSAGE_MAX_BYTES) or b"null")
        except (OSError, ValueError) as exc:
            ready = exc
        if not isinstance(ready, dict) or ready.get("ready") != proc.pid:
            self._broken(f"did not start ({ready})")
            return None
        ours.settimeout(ANSWER_TIMEOUT_S)
        log.info("spawner_ready pid=%d", proc.pid)
        return ours

    def _broken(self, why: str) -> None:
        """Stop a spawner that failed (under the lock); the next cold start starts another,
        unless this was the MAX_FAILURES-th failure in a row."""
        self._stop()
        self._failures += 1
        if self._failures >= MAX_FAILURES:
            self.disabled_because = why
            log.error("spawner_disabled after %d failures in a row: the spawner %s; cold "
                      "children are forked by the worker process", self._failures, why)
        else:
            log.warning("spawner_failed: the spawner %s; this child is forked by the worker "
                        "process and the spawner replaced", why)

    def _stop(self) -> None:
        proc, sock = self._proc, self._sock
        self._proc = self._sock = None
        if sock is not None:
            sock.close()
        if proc is not None:
            proc.kill()
            proc.wait()


def _raise(answer: Mapping[str, Any]) -> None:
    """Raise what `Popen` would have raised for a child the spawner could not start."""
    kind, message = answer.get("error"), str(answer.get("message", ""))
    number = answer.get("errno") if isinstance(answer.get("errno"), int) else 0
    if kind == "exec" and number:
        raise OSError(number, message or os.strerror(number))
    if kind == "value":
        raise ValueError(message)
    if kind in ("setup", "request"):
        raise subprocess.SubprocessError(f"the child's setup failed: {message}")


def _readable(fd: int, timeout_s: float | None) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(None if timeout_s is None else max(0, timeout_s) * 1000))
