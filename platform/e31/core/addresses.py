"""Which addresses an `http(s)://` input may reach: public ones, and the networks an operator
lists in `input_allowed_networks` (docs/jobs.md, "Your data: `inputs`").

An input is fetched by the worker, from the worker's network, whatever the job's own network:
an input naming `http://127.0.0.1:<port>/…` or `http://169.254.169.254/…` would read the pool's
own services or the cloud's metadata into the job's input directory (server-side request
forgery). So an address that is not public is refused unless an allowed network holds it:
loopback, link-local, private, unspecified (`0.0.0.0`, `::`), multicast, reserved, and the
other special-purpose ranges (shared address space, benchmarking, documentation). An IPv6
address that carries an IPv4 one (IPv4-mapped `::ffff:127.0.0.1`, NAT64 `64:ff9b::/96`, 6to4
`2002::/16`) is judged by the IPv4 address it carries.

The API refuses what a URL shows (`url_refusal`: an IP literal, `localhost`); the worker
refuses every address its host name resolves to, at the connection, after every redirect
(`e31_worker.attempt.http_inputs`). Both use `refusal`. Pure: nothing here reads the network.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence
from urllib.parse import unquote, urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")     # RFC 6052: an IPv4 address in the low 32 bits
_LOW_32_BITS = 0xFFFFFFFF
# The kinds of address that are refused, in the order they are named (the first that fits).
_KINDS: tuple[tuple[str, str], ...] = (
    ("is_unspecified", "an unspecified address"),
    ("is_loopback", "a loopback address"),
    ("is_link_local", "a link-local address"),
    ("is_multicast", "a multicast address"),
    ("is_reserved", "a reserved address"),
    ("is_private", "a private address"),
)
ALLOW_HINT = "an operator may allow its network in input_allowed_networks"


def carried(ip: IPAddress) -> IPAddress:
    """The IPv4 address an IPv6 address stands for (mapped, NAT64, 6to4), else `ip` itself."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return ip.ipv4_mapped
        if ip in _NAT64:
            return ipaddress.IPv4Address(int(ip) & _LOW_32_BITS)
        if ip.sixtofour is not None:
            return ip.sixtofour
    return ip


def refusal(address: str | IPAddress, allowed: Sequence[str]) -> str | None:
    """Why an input may not reach `address` ("a loopback address"), or None when it may: a
    public address, or one inside a network of `allowed` (CIDR strings, settings
    `input_allowed_networks`)."""
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id:
        ip = ipaddress.IPv6Address(str(ip).split("%", 1)[0])
    inner = carried(ip)
    for net in allowed:
        network = ipaddress.ip_network(net, strict=False)
        if ip in network or inner in network:
            return None
    for kind, words in _KINDS:
        if getattr(inner, kind):
            return words
    if isinstance(inner, ipaddress.IPv6Address) and inner.is_site_local:
        return "a site-local address"
    if not inner.is_global:
        return "not a public address"
    return None


def literal_address(host: str) -> IPAddress | None:
    """The address `host` names without a lookup (`127.0.0.1`, `::1`, and the forms a
    resolver reads as numbers too: `127.1`, `2130706433`, `0x7f.1`), or None for a name."""
    if ":" in host:     # IPv6: without its zone (`fe80::1%eth0`), which names an interface
        host = unquote(host).split("%", 1)[0]
    try:
        found = socket.getaddrinfo(host, None, flags=socket.AI_NUMERICHOST)
    except (socket.gaierror, UnicodeError, ValueError):
        return None
    return ipaddress.ip_address(str(found[0][4][0]))


def url_refusal(url: str, allowed: Sequence[str]) -> str | None:
    """Why the `http(s)://` input `url` is refused from its text alone: its host is
    `localhost` (or a name under it) or an address `refusal` refuses; None when nothing in
    the text shows it (the worker checks the addresses a name resolves to)."""
    try:
        host = urlsplit(url).hostname
    except ValueError:
        return None     # no address to judge: the worker's fetch fails it (reason setup)
    if not host:
        return None     # no address to judge: the worker's fetch fails it (reason setup)
    name = host.rstrip(".").lower()
    if name == "localhost" or name.endswith(".localhost"):
        if refusal("127.0.0.1", allowed) is None or refusal("::1", allowed) is None:
            return None     # the worker judges the address the name resolves to
        return f"its host {host} is this machine (loopback); {ALLOW_HINT}"
    ip = literal_address(host)
    if ip is None:
        return None
    why = refusal(ip, allowed)
    return None if why is None else f"its host {host} is {why}; {ALLOW_HINT}"
