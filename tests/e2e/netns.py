"""Hosts as network namespaces on one bridge, for the multi-host test (tests/e2e/test_multihost.py).

    net = Network.create(["control", "gpu-a", "gpu-b", "client"])   # 10.232.N.1, .2, ...
    net.popen("gpu-a", [...])          # a process on that host, in a session of its own
    net.cut("gpu-b"); net.restore("gpu-b")   # pull and plug its cable (its veth's bridge end)
    net.destroy()                      # every namespace, link and the bridge

Each host is a namespace (`ip netns add`) with a veth pair whose other end is a port of a
bridge in the root namespace; the bridge holds the `.254` address of the /24, so the test
process (the operator's seat) reaches every host, and a host reaches the others only over the
bridge: its 127.0.0.1 is its own. Names carry a tag unique to the run, and the /24 is one no
interface of this machine uses, so what a run that crashed before its cleanup left behind
(`ip netns list | grep e31mh-`) does not collide with the next run.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

NAME_PREFIX = "e31mh"        # every namespace of these tests starts so: a sweep finds them
LINK_PREFIX = "e31m"         # ... and every link (interface names have at most 15 characters)
SUBNET_BASE = "10.232"       # 10.232.N.0/24, N chosen free per run
OPERATOR_OCTET = 254         # the bridge's own address: the test process's seat
IP_TIMEOUT_S = 30


class NetnsUnavailable(Exception):
    """Namespaces cannot be made here; the message says why (the test skips with it)."""


def _ip(*args: str, netns: str | None = None, check: bool = True) -> str:
    argv = ["ip", *(["-n", netns] if netns else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if check and done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, argv, done.stdout, done.stderr)
    return done.stdout


def unavailable() -> str | None:
    """Why hosts cannot be built as namespaces here, or None."""
    if os.geteuid() != 0:
        return "the multi-host test needs root for `ip netns add` (network namespaces)"
    if not shutil.which("ip"):
        return "the multi-host test needs iproute2's `ip`"
    probe = f"{NAME_PREFIX}-probe-{secrets.token_hex(3)}"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True,
                          timeout=IP_TIMEOUT_S)
    if done.returncode != 0:
        return f"`ip netns add` is not permitted here: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=IP_TIMEOUT_S)
    return None


def _free_subnet() -> str:
    used = _ip("-o", "-4", "addr", "show")
    for third in range(1, 255):
        subnet = f"{SUBNET_BASE}.{third}"
        if f" {subnet}." not in used:
            return subnet
    raise NetnsUnavailable(f"no free {SUBNET_BASE}.N.0/24 left on this machine")


@dataclass
class Network:
    tag: str
    subnet: str                                   # "10.232.N"
    hosts: dict[str, str] = field(default_factory=dict)   # host -> its namespace
    addresses: dict[str, str] = field(default_factory=dict)
    _links: dict[str, str] = field(default_factory=dict)  # host -> its veth's bridge end

    @property
    def bridge(self) -> str:
        return f"{LINK_PREFIX}{self.tag}br"

    @property
    def operator_ip(self) -> str:
        return f"{self.subnet}.{OPERATOR_OCTET}"

    @classmethod
    def create(cls, hosts: Sequence[str]) -> Network:
        """The bridge and one namespace per host, addresses .1, .2, ... in host order. On any
        failure what was made is removed before the error is raised."""
        why = unavailable()
        if why:
            raise NetnsUnavailable(why)
        net = cls(tag=secrets.token_hex(2), subnet=_free_subnet())
        try:
            _ip("link", "add", net.bridge, "type", "bridge")
            _ip("addr", "add", f"{net.operator_ip}/24", "dev", net.bridge)
            _ip("link", "set", net.bridge, "up")
            for i, host in enumerate(hosts, start=1):
                net._add_host(host, i)
        except BaseException:
            net.destroy()
            raise
        return net

    def _add_host(self, host: str, octet: int) -> None:
        ns = f"{NAME_PREFIX}-{self.tag}-{host}"
        outer, inner = f"{LINK_PREFIX}{self.tag}h{octet}", f"{LINK_PREFIX}{self.tag}n{octet}"
        _ip("netns", "add", ns)
        self.hosts[host] = ns
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        self._links[host] = outer
        _ip("link", "set", inner, "netns", ns)
        _ip("link", "set", outer, "master", self.bridge)
        _ip("link", "set", outer, "up")
        address = f"{self.subnet}.{octet}"
        _ip("addr", "add", f"{address}/24", "dev", inner, netns=ns)
        _ip("link", "set", inner, "up", netns=ns)
        _ip("link", "set", "lo", "up", netns=ns)
        self.addresses[host] = address

    def argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """`argv` run on `host` (inside its namespace)."""
        return ["ip", "netns", "exec", self.hosts[host], *argv]

    def popen(self, host: str, argv: Sequence[str], *, env: Mapping[str, str],
              log: Path, cwd: Path | None = None) -> subprocess.Popen[bytes]:
        """A long-running process on `host`, in a session of its own (kill its group), its
        output appended to `log`."""
        out: IO[bytes] = open(log, "ab")
        with out:
            return subprocess.Popen(self.argv(host, argv), env=dict(env), stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    cwd=cwd, start_new_session=True)

    def run(self, host: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
            timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        """A command on `host`, to its end; its output captured."""
        return subprocess.run(self.argv(host, argv), env=dict(env) if env else None,
                              capture_output=True, text=True, timeout=timeout_s)

    def cut(self, host: str) -> None:
        """Pull the host's cable: packets to and from it vanish, without an error."""
        _ip("link", "set", self._links[host], "down")

    def restore(self, host: str) -> None:
        _ip("link", "set", self._links[host], "up")

    def destroy(self) -> None:
        """Remove every namespace, link and the bridge of this network; what is already gone
        is no error. (Processes still inside a namespace keep it alive, unnamed: stop them
        first.)"""
        for link in self._links.values():
            _ip("link", "del", link, check=False)
        for ns in self.hosts.values():
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", self.bridge, check=False)
        self._links.clear()
        self.hosts.clear()
