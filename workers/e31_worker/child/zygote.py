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

The processes of one warm attempt, like bubblewrap's in a cold one:

    outer   forked from here; a new session (its pgid is what the worker signals and records),
            the attempt's memory cgroup, the log pipe as stdout/stderr, every other fd closed,
            the job's environment shown in /proc/<pid>/environ (so a restarted worker's
            GroupRegistry finds its processes by E31_JOB_ID), then, when sandboxed, new
            mount, PID, IPC, UTS and cgroup namespaces (and network: none's, or the isolated
            one of `e31_worker.child.netns`, entered first while still in the host's network).
            It waits for `init` and writes `X<exit status>` to the status pipe, and kills
            the attempt if the worker process dies (it watches a pidfd of the worker, so the
            zygote's own death does not touch a running job).
    init    sandbox only: pid 1 of the new PID namespace; builds the job's root from the same
            binds bubblewrap gets (`Sandbox.bind_args`), a fresh /proc, pivot_root; forks the
            job and reaps; exits with the job's status (128 + N for signal N, as bubblewrap).
    job     a new session (sandbox), setgroups/setgid/setuid to the tenant's uid after the
            namespaces, no new privileges, dies with its parent, signal handlers and mask as
            a fresh Python's, the environment exactly the cold path's, the fds 0-2 only; then
            `runner.main`, which writes `S<monotonic time>` to the status pipe and closes it
            right before the entrypoint is imported: the worker's start latency.

Why the zygote's children report through a status pipe rather than being reparented to the
worker (PR_SET_CHILD_SUBREAPER): a subreaper worker would inherit every orphan of every job
(cold ones included) as zombies to reap, racing `subprocess`'s own waits; a pipe written by
`outer`, and the pidfd for liveness and signals, keep the worker's process table as it was.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import fcntl
import gc
import importlib
import io
import json
import os
import platform
import select
import signal
import socket
import struct
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import Any, NoReturn

from e31_worker.child import netns, runner

TORCH_AND_NUMPY = ("numpy", "torch")
MESSAGE_MAX_BYTES = 1 << 20
REAP_EVERY_MS = 1000
EXIT_SETUP = 125               # the warm child failed before any job code ran
SIGNAL_EXIT_BASE = 128         # init's exit status for a job killed by signal N: 128 + N
NEW_ROOT = "/run/e31-warm-root"  # mount point of a sandboxed job's root (in its namespace)

# Linux constants (include/uapi/linux/sched.h, mount.h, prctl.h, sockios.h, if.h).
CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS = 0x00020000, 0x02000000, 0x04000000
CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = 0x08000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
MNT_DETACH = 0x2
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV = 0x1, 0x2, 0x4
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_MM, PR_SET_NO_NEW_PRIVS = 1, 4, 35, 38
PR_SET_MM_MAP = 14
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}.get(platform.machine(), 155)
SYS_MOUNT_SETATTR = 442
DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")
DEV_LINKS = (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
             ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2"))
SHARED_TMPFS = ("/tmp", "/dev/shm")  # writable by the job (mode 1777), as bubblewrap's are

_libc = ctypes.CDLL("libc.so.6", use_errno=True)
_libc.syscall.restype = ctypes.c_long
_base_path: list[str] = []     # sys.path without the zygote's cwd and PYTHONPATH entries
_keep: list[Any] = []          # memory the kernel points at (the environ block of a child)


@dataclass
class Job:
    """What the forked job process runs once it is in its sandbox."""

    job_file: str
    status_fd: int


class _MmMap(ctypes.Structure):
    """struct prctl_mm_map (include/uapi/linux/prctl.h)."""

    _fields_ = [("start_code", ctypes.c_uint64), ("end_code", ctypes.c_uint64),
                ("start_data", ctypes.c_uint64), ("end_data", ctypes.c_uint64),
                ("start_brk", ctypes.c_uint64), ("brk", ctypes.c_uint64),
                ("start_stack", ctypes.c_uint64), ("arg_start", ctypes.c_uint64),
                ("arg_end", ctypes.c_uint64), ("env_start", ctypes.c_uint64),
                ("env_end", ctypes.c_uint64), ("auxv", ctypes.c_void_p),
                ("auxv_size", ctypes.c_uint32), ("exe_fd", ctypes.c_uint32)]


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="e31_worker.child.zygote")
    parser.add_argument("--socket-fd", type=int, required=True)
    parser.add_argument("--preload", default="", help="comma-separated modules to import")
    args = parser.parse_args(argv)
    sock = socket.socket(fileno=args.socket_fd)
    worker = os.getppid()
    worker_fd = os.pidfd_open(worker)
    if os.getppid() != worker:  # the worker died between the two calls
        return 0
    preloaded, failed = _preload([*TORCH_AND_NUMPY, *filter(None, args.preload.split(","))])
    numpy = sys.modules.get("numpy")
    if numpy is not None:   # its first seeding does lazy work (60+ ms) once, here, not per job
        numpy.random.seed()
    _base_path[:] = _python_base_path()
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
    _run(job)   # only in a job process: the zygote never returns from _serve


def _preload(modules: list[str]) -> tuple[list[str], dict[str, str]]:
    done, failed = [], {}
    for name in modules:
        try:
            importlib.import_module(name)
            done.append(name)
        except Exception as exc:  # noqa: BLE001 - a preload that fails is only not warm
            failed[name] = f"{type(exc).__name__}: {exc}"
    return done, failed


def _python_base_path() -> list[str]:
    """sys.path as a fresh `python -m` of this interpreter has it without PYTHONPATH."""
    extra = {os.path.realpath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
             if p}
    return [p for p in sys.path[1:] if os.path.realpath(p) not in extra]


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
                return _outer(request, fds, worker_fd)
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
        _fail()
    return _outer(request, fds, worker_fd)


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _outer(request: dict[str, Any], fds: list[int], worker_fd: int) -> Job:
    """The attempt's outer process: see the module's docstring. Returns only in the job."""
    log_fd, status_fd = fds
    try:
        os.setsid()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # the job's group gets these; outer reports
        for procs in request.get("cgroup_procs") or ():   # memory, and pids in cgroup v1
            fd = os.open(procs, os.O_WRONLY)
            try:
                os.write(fd, b"0")
            finally:
                os.close(fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        _close_fds_but(0, 1, 2, status_fd, worker_fd)
        _show_environ(request["env"])
        sandbox = request.get("sandbox")
        if sandbox is not None:
            if sandbox.get("net"):   # job_network = isolated: its own, through slirp4netns
                netns.enter_isolated(sandbox["net"])
            flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP
            if sandbox["network"] == "none":
                flags |= CLONE_NEWNET
            _check(_libc.unshare(flags), "unshare")
            if sandbox["network"] == "none":
                _loopback_up()
        outer = os.getpid()
        pid = os.fork()
    except BaseException:  # noqa: BLE001 - said in the log; the worker starts it cold
        _fail()
    if pid == 0:
        os.close(worker_fd)
        # In its new PID namespace the outer process, outside it, reads as parent 0.
        _die_with_parent(0 if sandbox is not None else outer)
        if sandbox is not None:
            return _init(request, status_fd)
        return _enter_job(request, status_fd, sandboxed=False)
    try:
        code = _wait_or_follow_worker(pid, worker_fd)
        os.write(status_fd, f"X{code}\n".encode())
    except BaseException:  # noqa: BLE001
        _fail()
    os._exit(0)


def _wait_or_follow_worker(pid: int, worker_fd: int) -> int:
    """The child's exit status; if the worker process dies first, kill the attempt."""
    child_fd = os.pidfd_open(pid)
    poller = select.poll()
    poller.register(child_fd, select.POLLIN)
    poller.register(worker_fd, select.POLLIN)
    while True:
        ready = dict(poller.poll())
        if child_fd in ready:
            _, status = os.waitpid(pid, 0)
            return os.waitstatus_to_exitcode(status)
        if worker_fd in ready:   # the worker is gone: so is its job, as on the cold path
            os.kill(pid, signal.SIGKILL)
            os.killpg(0, signal.SIGKILL)


def _init(request: dict[str, Any], status_fd: int) -> Job:
    """pid 1 of the job's PID namespace: build its root, fork the job, reap, pass its status."""
    try:
        _build_root(request["sandbox"]["view"], request["cwd"])
        pid = os.fork()
    except BaseException:  # noqa: BLE001
        _fail()
    if pid == 0:
        _die_with_parent(1)
        return _enter_job(request, status_fd, sandboxed=True)
    os.close(status_fd)
    try:
        while True:
            done, status = os.wait()
            if done == pid:
                code = os.waitstatus_to_exitcode(status)
                os._exit(code if code >= 0 else SIGNAL_EXIT_BASE - code)
    except BaseException:  # noqa: BLE001
        _fail()


def _enter_job(request: dict[str, Any], status_fd: int, *, sandboxed: bool) -> Job:
    """The job process: its session, uid, signals, directory, environment and Python."""
    try:
        if sandboxed:
            os.setsid()
            uid = int(request["sandbox"]["uid"])
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            _prctl(PR_SET_DUMPABLE, 1)   # its own /proc/self, as after an exec
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after the uid change, which clears it
        _fresh_signals()
        os.chdir(request["cwd"])
        env = request["env"]
        os.environ.clear()
        os.environ.update(env)
        _fresh_python(request["cwd"], env, request["job_file"])
    except BaseException:  # noqa: BLE001
        _fail()
    return Job(job_file=request["job_file"], status_fd=status_fd)


def _fail() -> NoReturn:
    """Say what failed in the log (the worker shows it and starts the attempt cold) and end."""
    try:
        traceback.print_exc()
        sys.stderr.flush()
    finally:
        os._exit(EXIT_SETUP)


def _run(job: Job) -> NoReturn:
    """Run the job as `python -m e31_worker.child.runner JOB_JSON` would, and end it as a
    forked worker of multiprocessing ends: what a job can rely on at exit happens (its
    non-daemon threads are joined, atexit functions run, its open files and stdio flushed),
    but not the interpreter's teardown of every module, which in a fork of a process holding
    torch writes to (copies) most of its memory and costs seconds."""
    def user_code_next() -> None:
        os.write(job.status_fd, f"S{_monotonic()}\n".encode())
        os.close(job.status_fd)

    try:
        code = runner.main([job.job_file], on_user_code=user_code_next)
    except SystemExit as exc:
        code = _exit_status(exc.code)
    except BaseException:  # noqa: BLE001 - as Python itself reports an uncaught one
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # what Python's exit does first
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        code = code or 1
    for obj in gc.get_objects():   # the job's own objects only: the zygote's are frozen
        if isinstance(obj, io.IOBase):
            try:
                obj.flush()
            except Exception:  # noqa: BLE001 - closed, or not writable
                continue
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            continue
    os._exit(code)


def _exit_status(code: object) -> int:
    """The exit status Python gives `sys.exit(code)`."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _monotonic() -> float:
    import time
    return time.monotonic()


def _fresh_signals() -> None:
    """Dispositions and mask as a new Python has them."""
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            continue
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())


def _fresh_python(cwd: str, env: dict[str, str], job_file: str) -> None:
    """sys.path, argv, stdio and the seeds as a fresh `python -m ...runner` would have."""
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [cwd, *extra, *_base_path]
    importlib.invalidate_caches()   # the finders of the zygote's entries re-read their dirs
    sys.argv = [runner.__file__, job_file]
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    numpy = sys.modules.get("numpy")
    if numpy is not None:   # a fork shares the zygote's seed; a cold start draws its own
        numpy.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None and env.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(max(1, int(env["OMP_NUM_THREADS"])))


def _die_with_parent(parent: int) -> None:
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:   # it died already
        os.write(2, b"e31: the warm child's parent ended before it started\n")
        os._exit(EXIT_SETUP)


def _close_fds_but(*keep: int) -> None:
    for fd in sorted(int(n) for n in os.listdir("/proc/self/fd")):
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def _show_environ(env: dict[str, str]) -> None:
    """Make /proc/<pid>/environ of this process (and its children) show the job's
    environment, as an exec'd child's does: a restarted worker reaps by E31_JOB_ID.
    PR_SET_MM_MAP (CAP_CHECKPOINT_RESTORE, or CAP_SYS_RESOURCE) with every other field as
    the kernel has it now."""
    block = b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items())
    buf = ctypes.create_string_buffer(block, len(block))
    _keep.append(buf)
    stat = open("/proc/self/stat").read()
    fields = [int(f) for f in stat[stat.rindex(")") + 2:].split()[23:49]]   # fields 26..51
    start_code, end_code, start_stack = fields[0], fields[1], fields[2]
    start_data, end_data, start_brk, arg_start, arg_end = fields[19:24]
    _libc.sbrk.restype = ctypes.c_void_p
    brk = _libc.sbrk(0) or start_brk
    mm = _MmMap(start_code=start_code, end_code=end_code, start_data=start_data,
                end_data=end_data, start_brk=start_brk, brk=brk, start_stack=start_stack,
                arg_start=arg_start, arg_end=arg_end, env_start=ctypes.addressof(buf),
                env_end=ctypes.addressof(buf) + len(block), auxv=None, auxv_size=0,
                exe_fd=0xFFFFFFFF)
    _check(_libc.prctl(PR_SET_MM, PR_SET_MM_MAP, ctypes.byref(mm), ctypes.sizeof(mm), 0),
           "prctl(PR_SET_MM_MAP)")


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, ifreq))[1]
        fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


def _build_root(view: list[str], cwd: str) -> None:
    """The job's root from bubblewrap's bind arguments (`Sandbox.bind_args` and the
    attempt's own), with a fresh /proc of this PID namespace; then pivot_root into it."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    os.makedirs(NEW_ROOT, exist_ok=True)
    _mount("tmpfs", NEW_ROOT, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")
    i = 0
    while i < len(view):
        op = view[i]
        if op in ("--proc", "--dev", "--tmpfs"):
            target = _inside(view[i + 1])
            os.makedirs(target, exist_ok=True)
            if op == "--proc":
                _mount("proc", target, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            elif op == "--dev":
                _make_dev(target)
            else:
                mode = "1777" if view[i + 1] in SHARED_TMPFS else "0755"
                _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"mode={mode}")
            i += 2
        elif op in ("--ro-bind", "--ro-bind-try", "--bind", "--dev-bind-try"):
            src, target = view[i + 1], _inside(view[i + 2])
            i += 3
            if op.endswith("-try") and not os.path.exists(src):
                continue
            _mount_point(target, os.path.isdir(src))
            _mount(src, target, None, MS_BIND | MS_REC)
            attrs = MOUNT_ATTR_NOSUID | (0 if op == "--dev-bind-try" else MOUNT_ATTR_NODEV)
            _set_attrs(target, attrs | (MOUNT_ATTR_RDONLY if op.startswith("--ro") else 0))
        elif op == "--symlink":
            target = _inside(view[i + 2])
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.symlink(view[i + 1], target)
            i += 3
        else:
            i += 1
    os.chdir(NEW_ROOT)
    _check(_libc.syscall(SYS_PIVOT_ROOT, b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "umount old root")
    os.chdir("/")
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(cwd)


def _inside(path: str) -> str:
    return NEW_ROOT + path


def _mount_point(target: str, is_dir: bool) -> None:
    if os.path.lexists(target):
        return
    if is_dir:
        os.makedirs(target)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))


def _make_dev(target: str) -> None:
    """A minimal /dev like bubblewrap's: the harmless nodes bound from the host, fd links."""
    _mount("tmpfs", target, "tmpfs", MS_NOSUID, "mode=0755")
    for name in DEV_NODES:
        if os.path.exists(f"/dev/{name}"):
            _mount_point(f"{target}/{name}", False)
            _mount(f"/dev/{name}", f"{target}/{name}", None, MS_BIND)
    for name, link in DEV_LINKS:
        os.symlink(link, f"{target}/{name}")
    os.mkdir(f"{target}/shm")


def _set_attrs(target: str, attrs: int) -> None:
    """Read-only / nosuid / nodev on a bind and every mount below it (mount_setattr), or on
    the bind alone where the kernel is older than 5.12."""
    attr = _MountAttr(attr_set=attrs)
    if _libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, target.encode(), AT_RECURSIVE,
                     ctypes.byref(attr), ctypes.sizeof(attr)) == 0:
        return
    flags = MS_REMOUNT | MS_BIND
    flags |= MS_RDONLY if attrs & MOUNT_ATTR_RDONLY else 0
    flags |= MS_NOSUID if attrs & MOUNT_ATTR_NOSUID else 0
    flags |= MS_NODEV if attrs & MOUNT_ATTR_NODEV else 0
    _mount(None, target, None, flags)


def _mount(source: str | None, target: str, fstype: str | None, flags: int,
           data: str | None = None) -> None:
    _check(_libc.mount(source.encode() if source else None, target.encode(),
                       fstype.encode() if fstype else None, ctypes.c_ulong(flags),
                       data.encode() if data else None), f"mount {target}")


def _prctl(option: int, value: int) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0), f"prctl({option})")


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"warm start: {what}: {os.strerror(err)}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
