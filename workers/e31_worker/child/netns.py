"""A job's own network (`job_network = "isolated"`, docs/security.md, "A job's own network"):
entered by the forked child, as root, before it drops to the job's uid. Standard library only:
the warm process (`e31_worker.child.zygote`) runs it too.

    unshare(CLONE_NEWNET) → setns back to the host's network → start slirp4netns
    --configure --disable-host-loopback --netns-type=path <the new namespace> tap0 there →
    setns into the new namespace → wait for its ready fd → bring up the loopback and add a
    reject route for every blocked network (ioctl)

so the job has a loopback of its own and a tap device whose traffic slirp4netns (user-mode
networking, in the host's network) turns into ordinary sockets of the host: the internet is
reachable; the host's loopback is not (its 127.0.0.1 is the namespace's own, and the gateway
does not stand for the host's loopback), and neither are the private, link-local and special
networks, the host's own addresses or the pool's service addresses, each of which the routing
table refuses (EHOSTUNREACH) before a packet leaves the namespace. The job runs without
capabilities in that namespace, so it cannot change the routes. The routes are added in this
process (SIOCADDRT), not by `ip`: an exec fewer on every start (about 7 ms of 26).

slirp4netns is started by `subprocess` without a fork of this process (a vfork and an exec:
this process is a copy of the warm process, torch and all, and a fork of it costs about 9 ms
of CPU to copy and tear down; the vfork 0.7 ms), which is why the namespace is made first and
slirp4netns given it by path, from the host's network that this process steps back into for
the start. It ends with this process: this process becomes bubblewrap (a cold start) or stays
the attempt's outer process (a warm start), both of which live exactly as long as the job.
slirp4netns's `--exit-fd` is a pidfd of this process, which hangs up once it has ended and
been reaped. It is not in the attempt's cgroups (the child joins them after this, and on
the warm path the outer process kills slirp4netns as soon as the job ends), because its exit
takes about 30 ms, its tap device's teardown, that the removal of the job's cgroups would
wait for at every job's end.
"""

from __future__ import annotations

import ctypes
import fcntl
import ipaddress
import os
import select
import socket
import struct
import subprocess
from collections.abc import Mapping, Sequence
from typing import cast

from e31_worker.child.linuxcalls import check, libc

CLONE_NEWNET = 0x40000000
CONTEXT = "job network"      # what its errors begin with
READY_TIMEOUT_S = 10.0       # slirp4netns configures the tap in milliseconds; a hang is a fault
TAP = "tap0"
SLIRP_GATEWAY = "10.0.2.2"   # slirp4netns's gateway (--configure): where its traffic leaves
MTU = 65520                  # slirp4netns's recommended MTU: fewer, larger frames through it
# include/uapi/linux/sockios.h, route.h, if.h
SIOCADDRT, SIOCGIFFLAGS, SIOCSIFFLAGS = 0x890B, 0x8913, 0x8914
RTF_UP, RTF_GATEWAY, RTF_HOST, RTF_REJECT = 0x1, 0x2, 0x4, 0x200
IFF_UP = 0x1


class _SockaddrIn(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("port", ctypes.c_ushort),
                ("addr", ctypes.c_ubyte * 4), ("zero", ctypes.c_ubyte * 8)]


class _RtEntry(ctypes.Structure):
    """struct rtentry (include/uapi/linux/route.h): one IPv4 route for SIOCADDRT."""

    _fields_ = [("rt_pad1", ctypes.c_ulong), ("rt_dst", _SockaddrIn),
                ("rt_gateway", _SockaddrIn), ("rt_genmask", _SockaddrIn),
                ("rt_flags", ctypes.c_ushort), ("rt_pad2", ctypes.c_short),
                ("rt_pad3", ctypes.c_ulong), ("rt_pad4", ctypes.c_void_p),
                ("rt_metric", ctypes.c_short), ("rt_dev", ctypes.c_char_p),
                ("rt_mtu", ctypes.c_ulong), ("rt_window", ctypes.c_ulong),
                ("rt_irtt", ctypes.c_ushort)]


def enter_isolated(net: Mapping[str, object]) -> subprocess.Popen[bytes]:
    """Move this process into a new network namespace with user-mode networking and the
    blocked networks refused. `net`, as `JobNetwork.plan` gives it: `slirp4netns` (an
    absolute path), `blocked` (IPv4 networks) and `allowed` (IPv4 addresses reached all the
    same, through slirp4netns). Returns slirp4netns's process, a child of this one, which ends
    on its own with this process (and its caller may end and reap it first). Raises OSError."""
    slirp = str(net["slirp4netns"])
    blocked = [str(n) for n in cast(Sequence[str], net.get("blocked") or ())]
    allowed = [str(a) for a in cast(Sequence[str], net.get("allowed") or ())]
    host = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    ready_r, ready_w = os.pipe()
    helper = None
    try:
        check(libc.unshare(CLONE_NEWNET), "unshare", context=CONTEXT)
        ours = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            # slirp4netns lives in the host's network: back there for its start, then into ours
            check(libc.setns(host, CLONE_NEWNET), "setns to the host's network", context=CONTEXT)
            gone = os.pidfd_open(os.getpid())   # hangs up once this process has ended
            try:
                helper = subprocess.Popen(
                    [slirp, "--configure", f"--mtu={MTU}", "--disable-host-loopback",
                     f"--ready-fd={ready_w}", f"--exit-fd={gone}", "--netns-type=path",
                     f"/proc/self/fd/{ours}", TAP],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL, close_fds=True, pass_fds=(ready_w, gone, ours))
            finally:
                os.close(gone)
            check(libc.setns(ours, CLONE_NEWNET), "setns to the job's network", context=CONTEXT)
        finally:
            os.close(ours)
        os.close(ready_w)
        ready_w = -1
        if not select.select([ready_r], [], [], READY_TIMEOUT_S)[0] or not os.read(ready_r, 1):
            raise OSError(f"job network: slirp4netns did not configure the namespace within "
                          f"{READY_TIMEOUT_S:g} s")
        route(blocked, allowed)
    except BaseException:
        if helper is not None:
            helper.kill()
        raise
    finally:
        os.close(host)
        os.close(ready_r)
        if ready_w >= 0:
            os.close(ready_w)
    return helper


def route(blocked: Sequence[str], allowed: Sequence[str] = ()) -> None:
    """In this process's network namespace: the loopback up, a reject route for each network
    of `blocked`, and a host route through slirp4netns's gateway for each address of
    `allowed` (more specific than any network, so reached all the same)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, ifreq))[1]
        fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))
        for text in blocked:
            net = ipaddress.IPv4Network(text)
            _add(s, net.network_address, net.netmask, None,
                 RTF_UP | RTF_REJECT | (RTF_HOST if net.prefixlen == 32 else 0))
        for text in allowed:
            _add(s, ipaddress.IPv4Address(text), ipaddress.IPv4Address("255.255.255.255"),
                 ipaddress.IPv4Address(SLIRP_GATEWAY), RTF_UP | RTF_GATEWAY | RTF_HOST)


def _add(s: socket.socket, dst: ipaddress.IPv4Address, mask: ipaddress.IPv4Address,
         gateway: ipaddress.IPv4Address | None, flags: int) -> None:
    entry = _RtEntry(rt_dst=_sockaddr(dst), rt_genmask=_sockaddr(mask), rt_flags=flags,
                     rt_gateway=_sockaddr(gateway) if gateway is not None else _SockaddrIn())
    fcntl.ioctl(s.fileno(), SIOCADDRT, bytes(memoryview(entry).cast("B")))


def _sockaddr(address: ipaddress.IPv4Address) -> _SockaddrIn:
    return _SockaddrIn(family=socket.AF_INET, addr=(ctypes.c_ubyte * 4)(*address.packed))
