"""The outer and init processes of a warm attempt, between the zygote's fork and the job.

    outer   forked from the zygote; a new session (its pgid is what the worker signals and
            records), the log pipe as stdout/stderr, every other fd closed, the job's
            environment shown in /proc/<pid>/environ (so a restarted worker's GroupRegistry
            finds its processes by E31_JOB_ID), the isolated network of
            `e31_worker.child.netns` when it has one, the attempt's cgroups (after the
            network, so that its slirp4netns stays out of them), then, when sandboxed, new
            mount, PID, IPC, UTS and cgroup namespaces (and network: none's, unless isolated).
            It waits for `init`, kills the job's slirp4netns, writes `X<exit status>` to the
            status pipe, and kills the attempt if the worker process dies (it watches a pidfd
            of the worker, so the zygote's own death does not touch a running job).
    init    sandbox only: pid 1 of the new PID namespace; builds the job's root
            (`e31_worker.child.warmroot`), forks the job and reaps; exits with the job's status
            (128 + N for signal N, as bubblewrap).

The job process itself is `e31_worker.child.warmjob`'s.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import select
import signal
import socket
import struct
from typing import Any

from e31_worker.child import netns
from e31_worker.child.linuxcalls import PR_SET_PDEATHSIG, check, join_cgroups, libc, prctl
from e31_worker.child.warmjob import EXIT_SETUP, Job, enter_job, fail
from e31_worker.child.warmroot import build_root

SIGNAL_EXIT_BASE = 128         # init's exit status for a job killed by signal N: 128 + N

# Linux constants (include/uapi/linux/sched.h, prctl.h, sockios.h, if.h).
CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS = 0x00020000, 0x02000000, 0x04000000
CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = 0x08000000, 0x20000000, 0x40000000
PR_SET_MM, PR_SET_MM_MAP = 35, 14
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1

_keep: list[Any] = []          # memory the kernel points at (the environ block of a child)


class _MmMap(ctypes.Structure):
    """struct prctl_mm_map (include/uapi/linux/prctl.h)."""

    _fields_ = [("start_code", ctypes.c_uint64), ("end_code", ctypes.c_uint64),
                ("start_data", ctypes.c_uint64), ("end_data", ctypes.c_uint64),
                ("start_brk", ctypes.c_uint64), ("brk", ctypes.c_uint64),
                ("start_stack", ctypes.c_uint64), ("arg_start", ctypes.c_uint64),
                ("arg_end", ctypes.c_uint64), ("env_start", ctypes.c_uint64),
                ("env_end", ctypes.c_uint64), ("auxv", ctypes.c_void_p),
                ("auxv_size", ctypes.c_uint32), ("exe_fd", ctypes.c_uint32)]


def run_outer(request: dict[str, Any], fds: list[int], worker_fd: int) -> Job:
    """The attempt's outer process: see the module's docstring. Returns only in the job."""
    log_fd, status_fd = fds
    try:
        os.setsid()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # the job's group gets these; outer reports
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        _close_fds_but(0, 1, 2, status_fd, worker_fd)
        _show_environ(request["env"])
        sandbox = request.get("sandbox")
        slirp = None
        if sandbox is not None and sandbox.get("net"):   # isolated: through slirp4netns
            slirp = netns.enter_isolated(sandbox["net"])
        # The attempt's cgroups after slirp4netns has started, which stays in the worker's: its
        # exit takes about 30 ms (its tap device's teardown), which the removal of the job's
        # cgroups would otherwise wait for at every job's end.
        join_cgroups(request.get("cgroup_procs") or ())
        if sandbox is not None:
            flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP
            if sandbox["network"] == "none":
                flags |= CLONE_NEWNET
            check(libc.unshare(flags), "unshare")
            if sandbox["network"] == "none":
                _loopback_up()
        outer = os.getpid()
        pid = os.fork()
    except BaseException:  # noqa: BLE001 - said in the log; the worker starts it cold
        fail()
    if pid == 0:
        os.close(worker_fd)
        # In its new PID namespace the outer process, outside it, reads as parent 0.
        _die_with_parent(0 if sandbox is not None else outer)
        if sandbox is not None:
            return _init(request, status_fd)
        return enter_job(request, status_fd, sandboxed=False)
    try:
        code = _wait_or_follow_worker(pid, worker_fd)
        if slirp is not None:   # it would end with this process all the same; now is sooner
            slirp.kill()
        os.write(status_fd, f"X{code}\n".encode())
    except BaseException:  # noqa: BLE001
        fail()
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
        build_root(request["sandbox"]["view"], request["cwd"])
        pid = os.fork()
    except BaseException:  # noqa: BLE001
        fail()
    if pid == 0:
        _die_with_parent(1)
        return enter_job(request, status_fd, sandboxed=True)
    os.close(status_fd)
    try:
        while True:
            done, status = os.wait()
            if done == pid:
                code = os.waitstatus_to_exitcode(status)
                os._exit(code if code >= 0 else SIGNAL_EXIT_BASE - code)
    except BaseException:  # noqa: BLE001
        fail()


def _die_with_parent(parent: int) -> None:
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
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
    libc.sbrk.restype = ctypes.c_void_p
    brk = libc.sbrk(0) or start_brk
    mm = _MmMap(start_code=start_code, end_code=end_code, start_data=start_data,
                end_data=end_data, start_brk=start_brk, brk=brk, start_stack=start_stack,
                arg_start=arg_start, arg_end=arg_end, env_start=ctypes.addressof(buf),
                env_end=ctypes.addressof(buf) + len(block), auxv=None, auxv_size=0,
                exe_fd=0xFFFFFFFF)
    check(libc.prctl(PR_SET_MM, PR_SET_MM_MAP, ctypes.byref(mm), ctypes.sizeof(mm), 0),
           "prctl(PR_SET_MM_MAP)")


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, ifreq))[1]
        fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))
