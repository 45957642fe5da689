"""The warm process ("zygote") of a worker process: `python -m e31_worker.child.zygote`.

It imports the job runner, the job context, torch and numpy (and the `--preload` modules)
once, never initialises CUDA, and then forks one child per attempt on the worker's request
(Android's zygote pattern). The worker side is `e31_worker.attempt.warm`; docs/architecture.md,
"The warm start", tells the whole story.

Protocol: one SOCK_SEQPACKET socket pair, the worker's end and this end (`--socket-fd`).
This process first sends `{"ready": pid, "cuda_initialized": false, "preloaded": [...]}`;
then each request is one JSON message (the attempt: its job file, environment, cwd, cgroup,
sandbox view) with two descriptors: the write ends of the attempt's log pipe and of its
status pipe. The answer is `{"pid": N}` with a pidfd of the forked child, opened here while
the child cannot have been reaped (so its pid is never a recycled one). The child is forked
ahead of the request (a "spare" waiting on a socket of its own), so that a fork of a process
holding torch is not on the attempt's path; if the spare is gone, the zygote forks one then.

The processes of one warm attempt, like bubblewrap's in a cold one: `outer` (a new session,
the attempt's cgroup, its namespaces when sandboxed) and, when sandboxed, `init` (pid 1 of
the job's PID namespace, which builds its root) are `e31_worker.child.warmouter`'s; the job
process, which becomes a fresh Python and runs the job, is `e31_worker.child.warmjob`'s; the
sandbox's root filesystem is `e31_worker.child.warmroot`'s.

Why the zygote's children report through a status pipe rather than being reparented to the
worker (PR_SET_CHILD_SUBREAPER): a subreaper worker would inherit every orphan of every job
(cold ones included) as zombies to reap, racing `subprocess`'s own waits; a pipe written by
`outer`, and the pidfd for liveness and signals, keep the worker's process table as it was.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import select
import socket
import sys
from dataclasses import dataclass

from e31_worker.child.spawner import worker_link
from e31_worker.child.warmjob import Job, fail, remember_base_path, run_job
from e31_worker.child.warmouter import run_outer

TORCH_AND_NUMPY = ("numpy", "torch")
MESSAGE_MAX_BYTES = 1 << 20
REAP_EVERY_MS = 1000


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="e31_worker.child.zygote")
    parser.add_argument("--socket-fd", type=int, required=True)
    parser.add_argument("--preload", default="", help="comma-separated modules to import")
    args = parser.parse_args(argv)
    link = worker_link(args.socket_fd)
    if link is None:
        return 0
    sock, worker_fd = link
    preloaded, failed = _preload([*TORCH_AND_NUMPY, *filter(None, args.preload.split(","))])
    numpy = sys.modules.get("numpy")
    if numpy is not None:   # its first seeding does lazy work (60+ ms) once, here, not per job
        numpy.random.seed()
    remember_base_path()
    torch = sys.modules.get("torch")
    ready = {"ready": os.getpid(), "preloaded": preloaded, "failed": failed,
             "cuda_initialized": bool(torch is not None and torch.cuda.is_initialized())}
    try:
        sock.send(json.dumps(ready).encode())
    except OSError:   # the worker gave up on this one
        return 0
    gc.freeze()   # what is here stays shared: a child's collections never touch (copy) it
    job = _serve(sock, worker_fd)
    if job is None:
        return 0
    run_job(job)   # only in a job process: the zygote never returns from _serve


def _preload(modules: list[str]) -> tuple[list[str], dict[str, str]]:
    done, failed = [], {}
    for name in modules:
        try:
            importlib.import_module(name)
            done.append(name)
        except Exception as exc:  # noqa: BLE001 - a preload that fails is only not warm
            failed[name] = f"{type(exc).__name__}: {exc}"
    return done, failed


@dataclass
class _Spare:
    """A child forked ahead of the next request, waiting for it on its own socket: the fork
    (tens of milliseconds for a process holding torch, on a busy host) is off the path."""

    pid: int
    pidfd: int
    sock: socket.socket


def _serve(sock: socket.socket, worker_fd: int) -> Job | None:
    """Answer fork requests until the worker goes; returns only in a forked job process."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    poller.register(worker_fd, select.POLLIN)
    spare: _Spare | None = None
    while True:
        if spare is None:
            made = _fork_spare(sock, worker_fd)
            if isinstance(made, Job):
                return made    # in the job process
            spare = made
        events = dict(poller.poll(REAP_EVERY_MS))
        _reap()
        if worker_fd in events:
            return None
        if sock.fileno() not in events:
            continue
        msg, fds, _, _ = socket.recv_fds(sock, MESSAGE_MAX_BYTES, 4)
        if not msg:
            return None   # the worker closed its end
        try:
            request = json.loads(msg)
            if len(fds) != 2:
                raise ValueError(f"expected 2 descriptors, got {len(fds)}")
        except ValueError as exc:
            for fd in fds:
                os.close(fd)
            sock.send(json.dumps({"error": str(exc)}).encode())
            continue
        try:   # hand the request to the spare; if it is gone, fork one now
            socket.send_fds(spare.sock, [msg], fds)
            pid, pidfd = spare.pid, spare.pidfd
        except OSError:
            os.close(spare.pidfd)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                sock.close()
                spare.sock.close()
                return run_outer(request, fds, worker_fd)
            pidfd = os.pidfd_open(pid)   # before any reaping: the pid is surely this child's
        spare.sock.close()
        spare = None
        for fd in fds:
            os.close(fd)
        socket.send_fds(sock, [json.dumps({"pid": pid}).encode()], [pidfd])
        os.close(pidfd)


def _fork_spare(sock: socket.socket, worker_fd: int) -> _Spare | Job:
    """Fork the spare; in the spare, wait for its request and become the attempt's outer
    process (returns the Job only in the job process); it ends if the zygote or the worker
    goes first."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid != 0:
        theirs.close()
        return _Spare(pid=pid, pidfd=os.pidfd_open(pid), sock=ours)
    try:
        ours.close()
        sock.close()
        poller = select.poll()
        poller.register(theirs.fileno(), select.POLLIN)
        poller.register(worker_fd, select.POLLIN)
        if worker_fd in dict(poller.poll()):
            os._exit(0)
        msg, fds, _, _ = socket.recv_fds(theirs, MESSAGE_MAX_BYTES, 4)
        if not msg:
            os._exit(0)    # the zygote went
        theirs.close()
        request = json.loads(msg)
    except BaseException:  # noqa: BLE001
        fail()
    return run_outer(request, fds, worker_fd)


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
