"""A server "on the internet" for the job network tests: a network namespace of its own,
joined to this host by a veth pair, holding an address of TEST-NET-2 (198.51.100.0/24,
RFC 5737), which no interface of this machine uses and no job network blocks.

    with Internet.create() as net:      # 198.51.100.1:8080 answers "hello from the internet"
        ...
    Internet.unavailable()              # why it cannot be made here (the test skips), or None

A connection from the host (and so from slirp4netns, which makes a job's connections as the
host's sockets) reaches it through the veth; nothing leaves this machine. Names carry a tag
unique to the run, so that what a crashed run left behind does not collide with the next.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from types import TracebackType

from tests.conftest import wait_for

SUBNET = "198.51.100"         # TEST-NET-2: documentation space, not a private network
SERVER_OCTET, HOST_OCTET = 1, 254
PORT = 8080
GREETING = b"hello from the internet\n"
IP_TIMEOUT_S = 30
SERVER = f"""
import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("{SUBNET}.{SERVER_OCTET}", {PORT}))
s.listen(16)
while True:
    c, _ = s.accept()
    c.sendall({GREETING!r})
    c.close()
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=IP_TIMEOUT_S)


@dataclass
class Internet:
    netns: str
    link: str
    server: subprocess.Popen[bytes]
    address: str = f"{SUBNET}.{SERVER_OCTET}"
    port: int = PORT

    @staticmethod
    def unavailable() -> str | None:
        if os.geteuid() != 0:
            return "a namespace standing for the internet needs root (ip netns add)"
        if not shutil.which("ip"):
            return "a namespace standing for the internet needs iproute2's `ip`"
        return None

    @classmethod
    def create(cls) -> Internet:
        tag = secrets.token_hex(3)
        netns, link = f"e31inet-{tag}", f"e31n{tag}"
        _ip("netns", "add", netns)
        try:
            _ip("link", "add", link, "type", "veth", "peer", "name", f"{link}p")
            _ip("link", "set", f"{link}p", "netns", netns)
            _ip("addr", "add", f"{SUBNET}.{HOST_OCTET}/24", "dev", link)
            _ip("link", "set", link, "up")
            _ip("-n", netns, "addr", "add", f"{SUBNET}.{SERVER_OCTET}/24", "dev", f"{link}p")
            _ip("-n", netns, "link", "set", f"{link}p", "up")
            _ip("-n", netns, "link", "set", "lo", "up")
            server = subprocess.Popen(["ip", "netns", "exec", netns, sys.executable, "-c",
                                       SERVER], stdout=subprocess.DEVNULL)
        except BaseException:
            subprocess.run(["ip", "link", "del", link], capture_output=True)
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
            raise
        net = cls(netns=netns, link=link, server=server)
        wait_for(net.answers, timeout_s=IP_TIMEOUT_S, what="the internet's server")
        return net

    def answers(self) -> bool:
        try:
            with socket.create_connection((self.address, self.port), timeout=1) as s:
                return s.recv(64) == GREETING
        except OSError:
            return False

    def destroy(self) -> None:
        self.server.kill()
        self.server.wait()
        subprocess.run(["ip", "link", "del", self.link], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True)

    def __enter__(self) -> Internet:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.destroy()
