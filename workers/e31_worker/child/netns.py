"""A job's own network (`job_network = "isolated"`, docs/security.md, "A job's own network"):
entered by the forked child, as root, before it drops to the job's uid. Standard library only:
the warm process (`e31_worker.child.zygote`) runs it too.

    fork the helper (still in the host's network) → unshare(CLONE_NEWNET) → the helper execs
    slirp4netns --configure --disable-host-loopback <our pid> tap0 → wait for its ready fd →
    `ip -batch` brings up the loopback and adds a `prohibit` route for every blocked network

so the job has a loopback of its own and a tap device whose traffic slirp4netns (user-mode
networking, in the host's network) turns into ordinary sockets of the host: the internet is
reachable; the host's loopback is not (its 127.0.0.1 is the namespace's own, and the gateway
does not stand for the host's loopback), and neither are the private, link-local and special
networks, the host's own addresses or the pool's service addresses, each of which the routing
table refuses (EACCES) before a packet leaves the namespace. The job runs without capabilities
in that namespace, so it cannot change the routes.

The helper ends with the process that forked it: that process becomes bubblewrap (a cold
start) or the attempt's outer process (a warm start), both of which live exactly as long as
the job. slirp4netns's `--exit-fd` is a pidfd of that process, which hangs up once it has
ended and been reaped (PR_SET_PDEATHSIG alone would not do: bubblewrap runs as the job's uid,
which may not signal a root process). It is in the attempt's cgroups too, which the attempt's
end empties.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import time
from collections.abc import Mapping, Sequence

CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
READY_TIMEOUT_S = 10.0       # slirp4netns configures the tap in milliseconds; a hang is a fault
TAP = "tap0"
SLIRP_GATEWAY = "10.0.2.2"   # slirp4netns's gateway (--configure): where its traffic leaves
MTU = 65520                  # slirp4netns's recommended MTU: fewer, larger frames through it


def enter_isolated(net: Mapping[str, object]) -> None:
    """Move this process into a new network namespace with user-mode networking and the
    blocked networks refused. `net`: `slirp4netns` and `ip` (absolute paths) and `routes`
    (a file of `ip -batch` commands), as `JobNetwork.plan` gives them. Raises OSError."""
    slirp, ip, routes = str(net["slirp4netns"]), str(net["ip"]), str(net["routes"])
    libc = ctypes.CDLL(None, use_errno=True)
    go_r, go_w = os.pipe()
    ready_r, ready_w = os.pipe()
    target = os.getpid()
    helper = os.fork()
    if helper == 0:   # the helper: stays in the host's network
        try:
            os.close(go_w)
            os.close(ready_r)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != target:   # its parent died before the prctl
                os._exit(1)
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            for fd in map(int, os.listdir("/proc/self/fd")):
                if fd > 2 and fd not in (go_r, ready_w):
                    with contextlib.suppress(OSError):
                        os.close(fd)
            if os.read(go_r, 1) != b"g":   # the target's namespace is not made: give up
                os._exit(1)
            os.set_inheritable(ready_w, True)
            gone = os.pidfd_open(target)   # hangs up once the target has ended and is reaped
            os.set_inheritable(gone, True)
            os.execv(slirp, [slirp, "--configure", f"--mtu={MTU}", "--disable-host-loopback",
                             f"--ready-fd={ready_w}", f"--exit-fd={gone}", str(target), TAP])
        finally:
            os._exit(127)
    os.close(go_r)
    os.close(ready_w)
    try:
        if libc.unshare(CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"job network: unshare: {os.strerror(err)}")
        os.write(go_w, b"g")
        if not select.select([ready_r], [], [], READY_TIMEOUT_S)[0] or not os.read(ready_r, 1):
            raise OSError(f"job network: slirp4netns did not configure the namespace within "
                          f"{READY_TIMEOUT_S:g} s")
        _run([ip, "-batch", routes])
    except BaseException:
        os.kill(helper, signal.SIGKILL)
        raise
    finally:
        os.close(go_w)
        os.close(ready_r)


def route_batch(blocked: Sequence[str], allowed: Sequence[str] = ()) -> str:
    """The `ip -batch` commands of a job's namespace: its loopback up, each network of
    `blocked` refused, each address of `allowed` reached through slirp4netns all the same
    (a host route is more specific than any network)."""
    return ("link set lo up\n" + "".join(f"route add prohibit {net}\n" for net in blocked)
            + "".join(f"route add {addr}/32 via {SLIRP_GATEWAY}\n" for addr in allowed))


def _run(argv: list[str]) -> None:
    """Run `argv` to its end (a forked child's way: no threads, no subprocess module)."""
    pid = os.posix_spawn(argv[0], argv, {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() >= deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise OSError(f"job network: {' '.join(argv)} did not end")
        time.sleep(0.001)
    if os.waitstatus_to_exitcode(status) != 0:
        raise OSError(f"job network: {' '.join(argv)} failed "
                      f"(exit {os.waitstatus_to_exitcode(status)})")
