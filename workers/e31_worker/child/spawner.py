"""The cold-start spawner of a worker process: `python -m e31_worker.child.spawner`.

A cold child (bubblewrap for a command job, a job environment's first attempts, any attempt
a warm process could not fork) needs a fork whose child runs Python between fork and exec:
it enters the attempt's cgroups, stages the binds its uid cannot reach, enters the job's
network and drops to the job's uid (`child_setup`). `subprocess.Popen` with a `preexec_fn`
cannot use vfork, so the worker process, which holds its store, broker and the libraries of
a worker, paid a full fork of itself per attempt, its GIL held: 2.6 ms of its CPU and 6 ms
of wall time, three times that for a process holding torch, on this project's 2-core host
(`bench/cold_fork.py`, docs/performance.md). This process does those forks instead: it
imports the standard library and this package's child side only (14 MB), so its fork costs
a fraction of a millisecond, and it is single-threaded, so the forked child's Python
between fork and exec takes no lock another thread held.

Protocol (the worker side is `e31_worker.attempt.spawn`): one SOCK_SEQPACKET socket pair;
this process first sends `{"ready": pid}`. Each request is one JSON message,
`{"argv", "env", "cwd", "cgroup_procs", "enter"}` (`enter`: null, or the sandbox's
`{"uid", "staged", "net"}`), with two descriptors: the write ends of the attempt's log pipe
and of its status pipe. The child execs `argv` with `env` in `cwd` (`argv[0]` looked up on
`env`'s PATH), stdin /dev/null and stdout and stderr the log pipe, in a new session, as
`Popen(..., start_new_session=True, preexec_fn=child_setup(...))` would. The answer comes
once the child has exec'd, or failed to: `{"pid": N}` with a pidfd of it, or `{"error":
"exec" | "value" | "setup" | "request", "errno": N, "message": "..."}` (the worker raises what
`Popen` would have: an `OSError`, a `ValueError`, or a `SubprocessError` for a setup that
failed). When a child ends this process
reaps it and writes `X<status>` (`Popen.returncode`'s convention) to its status pipe.

It lives as long as the worker process: it watches a pidfd of it and exits when it has
gone, and its children, whose parent it is, die with it (PR_SET_PDEATHSIG), as cold children
died with the worker's supervising thread before.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import select
import signal
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from e31_worker.child.linuxcalls import check, join_cgroups
from e31_worker.child.netns import enter_isolated

PR_SET_PDEATHSIG = 1          # prctl option: signal the child when its parent thread dies
MESSAGE_MAX_BYTES = 1 << 20   # a request: an argv, an environment, a sandbox's binds
EXEC_WAIT_S = 60.0            # from the fork to the exec: the network's setup waits on slirp4netns
ERROR_MAX_BYTES = 4096
STAGE_DIR = Path("/run/e31-sandbox")  # staging mount point (a tmpfs in the child's namespace)

# Linux system call numbers and flags (include/uapi/linux/sched.h, mount.h).
CLONE_NEWNS = 0x00020000
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x1000, 0x4000, 0x40000


def child_setup(procs_files: Sequence[str],
                spec: Mapping[str, Any] | None = None) -> Callable[[], None]:
    """What the child does between fork and exec: enter its sandbox's isolated network (when
    `spec`, `Launch.spec`, has one: slirp4netns, which that starts, stays in the worker's
    cgroups, because its exit takes about 30 ms, its tap device's teardown, that the removal
    of the job's cgroups would wait for), its cgroups (so the memory and process caps and OOM
    accounting cover it from its first byte after that), the rest of its sandbox's `enter`
    (stage its binds, drop the worker's rights), and then die with its parent (a change of
    user clears that).

    It runs in a child forked from the parent that calls this, so it only calls what was
    resolved before the fork and raw system calls (no locks, no Python I/O objects).
    """
    prctl = prctl_function()
    network, enter = network_from(spec), enter_from(spec)
    procs = [p.encode() for p in procs_files]
    parent = os.getpid()

    def setup() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)   # at once: `enter` takes milliseconds
        if network is not None:
            network()
        join_cgroups(procs)
        if enter is not None:
            enter()
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)   # again: the change of user cleared it
        if os.getppid() != parent:   # it died meanwhile: start nothing nobody watches
            os._exit(1)

    return setup


@functools.cache
def prctl_function() -> Callable[..., int]:
    """libc's prctl, loaded once in the parent (never after fork in a child)."""
    return ctypes.CDLL("libc.so.6", use_errno=True).prctl


def enter_as(uid: int, staged: Sequence[Path]) -> Callable[[], None]:
    """What the child does as root between fork and exec: stage the binds its uid cannot
    reach (`e31_worker.attempt.binds`), then become `uid` (gid `uid`, no other group).
    Resolved before the fork: only system calls after it."""
    libc = _libc() if staged else None
    sources = [(str(p).encode(), str(STAGE_DIR / str(i)).encode(), p.is_dir())
               for i, p in enumerate(staged)]
    stage = str(STAGE_DIR).encode()
    if staged:
        STAGE_DIR.mkdir(mode=0o755, exist_ok=True)

    def enter() -> None:
        if libc is not None:
            _check(libc.unshare(CLONE_NEWNS), "unshare")
            _check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount private")
            _check(libc.mount(b"tmpfs", stage, b"tmpfs", MS_NOSUID | MS_NODEV, b"mode=0755"),
                   "mount tmpfs")
            for source, target, is_dir in sources:
                if is_dir:
                    os.mkdir(target)
                else:
                    os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o600))
                _check(libc.mount(source, target, None, MS_BIND | MS_REC, None), "bind")
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)

    return enter


def enter_from(spec: Mapping[str, Any] | None) -> Callable[[], None] | None:
    """The sandbox's `enter` from its JSON form (`Launch.spec`) but its network: stage the
    binds and drop to the uid."""
    if spec is None:
        return None
    return enter_as(int(spec["uid"]), [Path(p) for p in spec.get("staged") or ()])


def network_from(spec: Mapping[str, Any] | None) -> Callable[[], object] | None:
    """The step of the sandbox's `enter` that enters its isolated network (None when it has
    none), which comes before the job's cgroups and `enter_from`'s steps."""
    net = spec.get("net") if spec is not None else None
    if net is None:
        return None
    return lambda: enter_isolated(net)


def _check(result: int, what: str) -> None:
    check(result, what, context="sandbox staging")


@functools.cache
def _libc() -> ctypes.CDLL:
    """libc, loaded once in the parent (never after fork in a child)."""
    return ctypes.CDLL("libc.so.6", use_errno=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="e31_worker.child.spawner")
    parser.add_argument("--socket-fd", type=int, required=True)
    args = parser.parse_args(argv)
    link = worker_link(args.socket_fd)
    if link is None:
        return 0
    sock, worker_fd = link
    prctl_function()
    try:
        sock.send(json.dumps({"ready": os.getpid()}).encode())
    except OSError:
        return 0
    _serve(sock, worker_fd)
    return 0


def worker_link(socket_fd: int) -> tuple[socket.socket, int] | None:
    """A helper process's link to the worker that started it (the spawner's, the warm
    process's): its end of their socket pair, and a pidfd of the worker, readable once the
    worker has gone; None when the worker died before the pidfd was open."""
    sock = socket.socket(fileno=socket_fd)
    worker = os.getppid()
    worker_fd = os.pidfd_open(worker)
    if os.getppid() != worker:  # the worker died between the two calls
        sock.close()
        os.close(worker_fd)
        return None
    return sock, worker_fd


def _serve(sock: socket.socket, worker_fd: int) -> None:
    """Answer spawn requests and reap the children until the worker goes."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    poller.register(worker_fd, select.POLLIN)
    children: dict[int, tuple[int, int]] = {}   # pidfd: (pid, the status pipe's write end)
    while True:
        for fd, _ in poller.poll():
            if fd == worker_fd:
                return
            if fd in children:
                pid, status_w = children.pop(fd)
                poller.unregister(fd)
                _, status = os.waitpid(pid, 0)
                _say(status_w, f"X{os.waitstatus_to_exitcode(status)}\n")
                os.close(status_w)
                os.close(fd)
                continue
            msg, fds, _, _ = socket.recv_fds(sock, MESSAGE_MAX_BYTES, 4)
            if not msg:
                return   # the worker closed its end
            answer, child = _spawn(msg, fds)
            try:
                if child is None:
                    sock.send(json.dumps(answer).encode())
                else:
                    socket.send_fds(sock, [json.dumps(answer).encode()], [child[0]])
            except OSError:
                return   # the worker is going: so are its children, with this process
            if child is not None:
                pidfd, pid, status_w = child
                children[pidfd] = (pid, status_w)
                poller.register(pidfd, select.POLLIN)


def _spawn(msg: bytes, fds: list[int]) -> tuple[dict[str, Any], tuple[int, int, int] | None]:
    """Fork and exec one request's child: the answer, and (its pidfd, pid, status pipe) when
    it runs."""
    if len(fds) != 2:
        for fd in fds:
            os.close(fd)
        return {"error": "request", "errno": 0,
                "message": f"expected 2 descriptors, got {len(fds)}"}, None
    log_w, status_w = fds
    try:
        request = json.loads(msg)
        argv = [str(a) for a in request["argv"]]
        env = {str(k): str(v) for k, v in request["env"].items()}
        cwd = str(request["cwd"])
        setup = child_setup([str(p) for p in request.get("cgroup_procs") or ()],
                            request.get("enter"))
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as exc:
        os.close(log_w)
        os.close(status_w)
        return {"error": "request", "errno": 0, "message": f"{type(exc).__name__}: {exc}"}, None
    err_r, err_w = os.pipe()   # close-on-exec: EOF once the child has exec'd
    pid = os.fork()
    if pid == 0:
        _child(argv, env, cwd, setup, log_w, err_w)   # never returns
    os.close(err_w)
    os.close(log_w)
    said = _read_error(err_r)
    os.close(err_r)
    if said:
        os.kill(pid, signal.SIGKILL)   # it is ending, or it hung before its exec
        os.waitpid(pid, 0)
        os.close(status_w)
        kind, _, rest = said.partition(":")
        number, _, message = rest.partition(":")
        return {"error": kind, "errno": int(number) if number.isdigit() else 0,
                "message": message}, None
    try:
        pidfd = os.pidfd_open(pid)   # not reaped yet: its pid is not a recycled one
    except OSError as exc:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(status_w)
        return {"error": "setup", "errno": exc.errno or 0, "message": str(exc)}, None
    return {"pid": pid}, (pidfd, pid, status_w)


def _child(argv: list[str], env: dict[str, str], cwd: str, setup: Callable[[], None],
           log_w: int, err_w: int) -> None:
    """In the forked child: the standard streams, a new session, `setup`, then the exec;
    what failed goes to `err_w` as `kind:errno:message`."""
    try:
        try:
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(log_w, 1)
            os.dup2(log_w, 2)
            os.closerange(3, err_w)
            os.closerange(err_w + 1, os.sysconf("SC_OPEN_MAX"))
            os.chdir(cwd)
        except OSError as exc:
            _say(err_w, f"exec:{exc.errno or 0}:{exc.strerror or exc}")
            os._exit(127)
        try:
            for number in (signal.SIGPIPE, signal.SIGXFSZ):   # as Popen's restore_signals
                signal.signal(number, signal.SIG_DFL)
            os.setsid()
            setup()
        except BaseException as exc:  # noqa: BLE001 - whatever it was, the child goes
            _say(err_w, f"setup:0:{type(exc).__name__}: {exc}")
            os._exit(127)
        try:
            os.execvpe(argv[0], argv, env)
        except OSError as exc:
            _say(err_w, f"exec:{exc.errno or 0}:{exc.strerror or exc}")
        except ValueError as exc:   # a NUL in an argument or the environment
            _say(err_w, f"value:0:{exc}")
    finally:
        os._exit(127)


def _read_error(fd: int) -> str:
    """What the child said before its exec, or "" once it exec'd (the pipe closed)."""
    chunks: list[bytes] = []
    while True:
        ready, _, _ = select.select([fd], [], [], EXEC_WAIT_S)
        if not ready:
            return "setup:0:the child did not exec in time"
        chunk = os.read(fd, ERROR_MAX_BYTES)
        if not chunk:
            return b"".join(chunks).decode(errors="replace")
        chunks.append(chunk)


def _say(fd: int, text: str) -> None:
    try:
        os.write(fd, text.encode(errors="replace"))
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
