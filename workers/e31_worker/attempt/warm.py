"""The warm start, worker side: the worker process's warm process (`e31_worker.child.zygote`)
and the attempts forked from it (docs/architecture.md, "The warm start").

`WarmStarter` owns the zygote: it starts it (in the background: a worker serves, cold, while
torch is imported), asks it to fork an attempt, and replaces it when it dies, does not answer
in time or answers garbage; that attempt then starts cold and the worker keeps serving. After
`MAX_FAILURES` warm attempts in a row that fail before their job's code (a host where the
sandbox cannot be entered this way), it stops trying: every attempt starts cold, said once
in the log.

`WarmPool` holds the worker process's `WarmStarter` and one more per job environment
(`python: {pip: [...]}`, `AttemptPlan.venv`), each run with that environment's interpreter,
started on the environment's first attempt (which starts cold while it warms), and stopped
least recently used first while the job environments' warm processes together hold more than
`warm_memory_budget_mb` (their proportional set size, `/proc/<pid>/smaps_rollup`). The
worker's own warm process is outside the budget and never stopped for it.

`WarmChild` is what the supervisor holds of a forked attempt, in place of a `Popen`: a
`PipedChild` (`e31_worker.attempt.spawn`: its pid, the attempt's process group as the cold
child's; `poll` / `wait` through a pidfd, the child being the zygote's, not ours; its exit
status from the status pipe its outer process writes; `stdout`, the read end of its log
pipe), which also says when its job is about to run its code (`started`).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from e31_worker.attempt.jobenv import inherited_env
from e31_worker.attempt.spawn import PipedChild

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 300.0   # the zygote imports torch: long on a loaded host
ANSWER_TIMEOUT_S = 10.0   # a fork takes milliseconds; no answer by then is a broken zygote
STARTED_TIMEOUT_S = 30.0  # from the fork to the job's first line (its sandbox is entered)
MAX_FAILURES = 3          # warm children in a row that failed before the job: stop trying
MESSAGE_MAX_BYTES = 1 << 16
PROBE_TIMEOUT_S = 30.0    # a job environment's interpreter finding the zygote and torch
# What a job environment's interpreter must find to run a warm process: found, not imported.
PROBE = """\
import importlib.util, sys
def found(name):
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False
missing = [m for m in ("e31_worker.child.zygote", "torch", "numpy") if not found(m)]
sys.exit("cannot import " + ", ".join(missing) if missing else 0)
"""


class WarmChild(PipedChild):
    """A forked attempt as the supervisor drives it (`PipedChild`), which also says when its
    job is about to run its code."""

    def started(self, timeout_s: float) -> float | None:
        """Block until the job is about to run its code: the monotonic time it said so, or
        None if it ended (or did not get there in `timeout_s`) first."""
        deadline = time.monotonic() + timeout_s
        while True:
            for line in self._lines:
                if line.startswith("S"):
                    try:
                        return float(line[1:])
                    except ValueError:
                        return None
            left = deadline - time.monotonic()
            if self._eof or left <= 0 or not self._read_status(left):
                return None


class WarmStarter:
    """The worker process's warm process: started, asked to fork attempts, replaced."""

    def __init__(self, *, preload: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 python: str = sys.executable,
                 on_ready: Callable[[], None] | None = None) -> None:
        self._preload = [m for m in preload if m]
        self._env = dict(env if env is not None else os.environ)
        self._python = python
        self._on_ready = on_ready          # told (from the starting thread) once it is ready
        self._lock = threading.Lock()      # one request at a time; one replacement at a time
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._ready: dict[str, Any] | None = None
        self._spawning = False
        self._closed = False
        self._failures = 0
        self.disabled_because: str | None = None

    @property
    def pid(self) -> int | None:
        """The zygote's pid while it is ready, else None."""
        return self._proc.pid if self._proc is not None and self._ready is not None else None

    @property
    def warming(self) -> bool:
        """Whether the zygote is being started now."""
        return self._spawning

    def memory_bytes(self) -> int:
        """What the ready zygote holds of the host's memory: its proportional set size (its
        pages shared with others counted in part), its resident size where PSS cannot be
        read; 0 when there is no ready zygote (or it just ended)."""
        pid = self.pid
        if pid is None:
            return 0
        for path, field in ((f"/proc/{pid}/smaps_rollup", "Pss:"),
                            (f"/proc/{pid}/status", "VmRSS:")):
            try:
                with open(path) as f:
                    for line in f:
                        if line.startswith(field):
                            return int(line.split()[1]) * 1024
            except (OSError, ValueError, IndexError):
                continue
        return 0

    def start(self) -> None:
        """Start (or replace) the zygote in the background; attempts start cold meanwhile."""
        with self._lock:
            if self._spawning or self._closed or self.disabled_because is not None:
                return
            self._spawning = True
        threading.Thread(target=self._spawn, name="warm-start", daemon=True).start()

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._ready is not None:
                return True
            if not self._spawning and self._ready is None:
                return False
            time.sleep(0.02)
        return False

    def _spawn(self) -> None:
        try:
            self._stop_zygote()
            if self._python != sys.executable and not self._probe():
                return
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            argv = [self._python, "-m", "e31_worker.child.zygote",
                    "--socket-fd", str(theirs.fileno())]
            if self._preload:
                argv += ["--preload", ",".join(self._preload)]
            try:
                proc = subprocess.Popen(argv, env=self._env, pass_fds=[theirs.fileno()],
                                        stdin=subprocess.DEVNULL, start_new_session=True)
            finally:
                theirs.close()
            ours.settimeout(READY_TIMEOUT_S)
            try:
                ready = json.loads(ours.recv(MESSAGE_MAX_BYTES) or b"null")
            except (OSError, ValueError) as exc:
                ready = None
                log.warning("warm_start_unavailable: the warm process did not start: %s", exc)
            if not isinstance(ready, dict) or "ready" not in ready:
                proc.kill()
                proc.wait()
                ours.close()
                self._failed("the warm process did not start")
                return
            if ready.get("cuda_initialized"):
                log.error("warm_start_refused: the warm process initialised CUDA (a preload "
                          "module?); attempts start cold")
                proc.kill()
                proc.wait()
                ours.close()
                self.disabled_because = "the warm process initialised CUDA"
                return
            if ready.get("failed"):
                log.warning("warm_preload_failed: %s", ready["failed"])
            with self._lock:
                if self._closed:
                    proc.kill()
                    proc.wait()
                    ours.close()
                    return
                self._proc, self._sock, self._ready = proc, ours, ready
            log.info("warm_start_ready pid=%d python=%s preloaded=%s", proc.pid, self._python,
                     ",".join(ready.get("preloaded", [])))
        finally:
            self._spawning = False
        if self._on_ready is not None and self._ready is not None:
            self._on_ready()

    def _probe(self) -> bool:
        """Whether this interpreter (a job environment's) finds what a warm process imports;
        if not, its attempts start cold for good, and the worker's log says why."""
        try:
            done = subprocess.run([self._python, "-c", PROBE], env=self._env,
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, timeout=PROBE_TIMEOUT_S, check=False)
            why = done.stderr.decode(errors="replace").strip().splitlines()[-1:] \
                if done.returncode else []
            ok = done.returncode == 0
        except (OSError, subprocess.SubprocessError) as exc:
            ok, why = False, [str(exc)]
        if not ok:
            self.disabled_because = f"{self._python}: {''.join(why) or 'failed'}"
            log.warning("warm_env_unavailable: %s; its attempts start cold",
                        self.disabled_because)
        return ok

    def fork(self, request: dict[str, Any]) -> WarmChild | None:
        """Fork one attempt from the zygote, or None when there is no ready zygote or it
        failed (then it is replaced in the background and this attempt starts cold)."""
        with self._lock:
            if self._ready is None or self._sock is None:
                return None
            log_r, log_w = os.pipe()
            status_r, status_w = os.pipe()
            try:
                socket.send_fds(self._sock, [json.dumps(request).encode()], [log_w, status_w])
                self._sock.settimeout(ANSWER_TIMEOUT_S)
                msg, fds, _, _ = socket.recv_fds(self._sock, MESSAGE_MAX_BYTES, 1)
                answer = json.loads(msg)
                if not isinstance(answer, dict) or not isinstance(answer.get("pid"), int) \
                        or len(fds) != 1:
                    for fd in fds:
                        os.close(fd)
                    raise ValueError(f"unexpected answer {msg[:200]!r}")
            except (OSError, ValueError) as exc:
                for fd in (log_r, status_r):
                    os.close(fd)
                log.warning("warm_start_failed: the warm process %s (%s); starting cold and "
                            "replacing it", "did not answer" if isinstance(exc, OSError)
                            else "answered garbage", exc)
                self._ready = None
                broken = True
            else:
                broken = False
            finally:
                os.close(log_w)
                os.close(status_w)
        if broken:
            self.start()
            return None
        return WarmChild(answer["pid"], fds[0], log_r, status_r)

    def child_failed(self, why: str) -> None:
        """A forked child ended before its job's code: replace the zygote; after
        MAX_FAILURES in a row, start every attempt cold."""
        self._failures += 1
        if self._failures >= MAX_FAILURES:
            self.disabled_because = why
            log.error("warm_start_disabled after %d failures in a row: %s; attempts start cold",
                      self._failures, why)
            with self._lock:
                self._ready = None
            self._stop_zygote()
            return
        with self._lock:
            self._ready = None
        self.start()

    def child_started(self) -> None:
        self._failures = 0

    def _failed(self, why: str) -> None:
        self._failures += 1
        if self._failures >= MAX_FAILURES:
            self.disabled_because = why
            log.error("warm_start_disabled: %s; attempts start cold", why)

    def _stop_zygote(self) -> None:
        with self._lock:
            proc, sock = self._proc, self._sock
            self._proc = self._sock = None
            self._ready = None
        if sock is not None:
            sock.close()
        if proc is not None:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        """Stop the zygote (running attempts forked from it go on: they are not its)."""
        with self._lock:
            self._closed = True
        self._stop_zygote()


class WarmPool:
    """The worker process's warm processes: its own environment's (`base`, never stopped for
    memory) and one per job environment, kept for the most recently used environments while
    their warm processes hold at most `budget_bytes` together."""

    def __init__(self, base: WarmStarter, *, budget_bytes: int, preload: Sequence[str] = (),
                 env: Mapping[str, str] | None = None) -> None:
        self.base = base
        self.budget_bytes = budget_bytes   # the job environments' warm processes together
        self._preload = list(preload)
        self._env = dict(env if env is not None else os.environ)
        self._lock = threading.Lock()
        self._envs: OrderedDict[str, WarmStarter] = OrderedDict()  # least recently used first
        self._closed = False

    def start(self) -> None:
        self.base.start()

    def starter(self, venv: Path | None) -> WarmStarter | None:
        """The warm process for an attempt in `venv` (None: the worker's environment), marked
        as the most recently used; started now if it is not (this attempt starts cold), None
        when the pool is closed or the environment cannot have one."""
        if venv is None:
            return self.base
        key = str(venv)
        with self._lock:
            if self._closed:
                return None
            warm = self._envs.get(key)
            if warm is None:
                env = dict(self._env, VIRTUAL_ENV=key,
                           PATH=f"{venv / 'bin'}{os.pathsep}{self._env.get('PATH', os.defpath)}")
                env.pop("PYTHONHOME", None)
                warm = WarmStarter(preload=self._preload, env=env,
                                   python=str(venv / "bin" / "python"), on_ready=self.trim)
                self._envs[key] = warm
                log.info("warm_env_starting venv=%s", key)
            self._envs.move_to_end(key)
        if warm.disabled_because is not None:
            return None
        if warm.pid is None and not warm.warming:
            warm.start()   # not started yet, or its zygote failed: (re)started in the background
        self.trim()
        return warm

    def trim(self) -> None:
        """Stop the least recently used job environments' warm processes while the ready ones
        hold more than the budget together. The most recently used ready one stays, even alone
        over the budget; one still starting holds nothing yet and takes nothing's place."""
        with self._lock:
            ready = [(key, warm, warm.memory_bytes()) for key, warm in self._envs.items()
                     if warm.pid is not None]
            total = sum(size for _, _, size in ready)
            evicted: list[tuple[str, WarmStarter, int]] = []
            for key, warm, size in ready[:-1]:
                if total <= self.budget_bytes:
                    break
                del self._envs[key]
                evicted.append((key, warm, size))
                total -= size
        for key, warm, size in evicted:
            log.info("warm_env_evicted venv=%s pss_mb=%.0f total_mb=%.0f budget_mb=%.0f", key,
                     size / 2**20, total / 2**20, self.budget_bytes / 2**20)
            warm.close()

    def close(self) -> None:
        """Stop every warm process (running attempts forked from them go on)."""
        with self._lock:
            self._closed = True
            envs = list(self._envs.values())
            self._envs.clear()
        for warm in (self.base, *envs):
            warm.close()


def warm_env(environ: Mapping[str, str], passthrough: Iterable[str] = ()) -> dict[str, str]:
    """The zygote's environment: what a job inherits of the worker's (`jobenv`), so that
    neither its E31_* settings (store and broker URLs, secrets' paths) nor its credentials
    are in the memory a warm job is forked from, nor in any /proc/pid/environ."""
    return inherited_env(environ, passthrough)
