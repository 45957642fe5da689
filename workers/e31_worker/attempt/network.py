"""The network a job gets (`job_network`; docs/security.md, "A job's own network").

- `isolated` (the default): a network namespace of its own, with user-mode networking
  (slirp4netns) to the internet, and a routing table that refuses the host's loopback, the
  private, link-local and special networks (the cloud's metadata address among them), the
  host's own addresses and the pool's service addresses (Redis, the store,
  the API, Flower, the artifact store's endpoint). Entered by the forked child as root, before
  its uid drops (`e31_worker.child.netns`), on the cold and the warm path alike.
- `host`: the worker's own network. Every job reaches what the worker reaches, the stack's
  Redis and Flower on 127.0.0.1 included: for pools whose jobs need a private network, said
  loudly by `e31 queue` and the docs.
- `none`: no network for any job (a loopback of its own), as `network: none` asks for one job.

A job's `network: none` means no network whatever the pool's setting. Without a sandbox
(`isolation = "process"`) the worker cannot make namespaces, and jobs share its network.

An environment build (`e31_worker.attempt.buildbox`) gets the host's network on a `host` pool,
and otherwise an isolated one whose routes also let it reach the operator's package indexes
(the hosts of `UV_INDEX_URL`, `UV_EXTRA_INDEX_URL`, `UV_DEFAULT_INDEX`, `UV_INDEX`,
`UV_FIND_LINKS`), wherever they are but on the host's loopback: the internet and the index.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import shutil
import socket
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from e31.edge.settings import Settings

log = logging.getLogger(__name__)

Mode = Literal["isolated", "host", "none"]

SLIRP4NETNS = "slirp4netns"
IP = "ip"                    # only to read the host's own addresses (`host_addresses`)
NET_DIR = ".net"             # under work_dir: the resolv.conf of jobs' namespaces
SLIRP_DNS = "10.0.2.3"       # slirp4netns's built-in DNS forwarder (to the host's resolver)
RESOLV_CONF_TEXT = f"nameserver {SLIRP_DNS}\n"
RESOLVE_TIMEOUT_S = 5.0
# uv's settings that name the operator's package indexes (a URL, or a local directory)
UV_INDEX_VARS = ("UV_INDEX_URL", "UV_DEFAULT_INDEX", "UV_EXTRA_INDEX_URL", "UV_INDEX",
                 "UV_FIND_LINKS")
# Never reachable from an isolated job: "this network", the private networks, shared address
# space (carrier-grade NAT; Alibaba's metadata at 100.100.100.200), loopback, link-local (the
# metadata services at 169.254.169.254), the IETF protocol block, multicast and reserved.
# slirp4netns's own 10.0.2.0/24 (gateway and DNS) stays reachable: its route is more specific.
BLOCKED_NETWORKS = ("0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8",
                    "169.254.0.0/16", "172.16.0.0/12", "192.0.0.0/24", "192.168.0.0/16",
                    "198.18.0.0/15", "224.0.0.0/4", "240.0.0.0/4")


@dataclass(frozen=True)
class JobNetwork:
    """The worker's choice of network for its jobs, and what an isolated one needs."""

    mode: Mode
    slirp4netns: str = ""
    net_dir: Path | None = None       # resolv.conf, written by `prepare`
    blocked: tuple[str, ...] = ()
    indexes: tuple[str, ...] = ()     # addresses of the package indexes builds may reach

    @classmethod
    def from_settings(cls, settings: Settings,
                      environ: Mapping[str, str] = os.environ) -> JobNetwork:
        """The pool's `job_network`, with the tools found and the blocked networks listed
        (the host's own addresses, the pool's service addresses and the package indexes
        resolved now, once)."""
        if settings.job_network == "host":
            return cls(mode="host")
        return cls(mode=settings.job_network, slirp4netns=shutil.which(SLIRP4NETNS) or "",
                   net_dir=settings.resolved_work_dir / NET_DIR,
                   blocked=blocked_networks(settings),
                   indexes=tuple(a for a in _resolve(index_hosts(environ))
                                 if not ipaddress.ip_address(a).is_loopback))

    def unavailable(self, mode: Mode | None = None) -> str | None:
        """Why this host cannot give jobs the chosen network (or `mode`), or None."""
        if (mode or self.mode) != "isolated":
            return None
        if not self.slirp4netns:
            return ("job_network = isolated needs slirp4netns (Debian/Ubuntu: apt-get install "
                    "slirp4netns); or set E31_JOB_NETWORK=host to give jobs the worker's "
                    "network (docs/security.md)")
        return None

    def prepare(self) -> None:
        """Write the resolv.conf every isolated namespace of this worker uses (slirp4netns's
        DNS forwarder: the host's resolver may be on its loopback). It is never replaced: a
        sandbox being set up binds it while another worker of the host prepares (a replaced
        file's old inode can no longer be bound)."""
        if self.net_dir is None or self.resolv_conf is None or self.resolv_conf.exists():
            return
        self.net_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.net_dir, 0o755)
        tmp = self.net_dir / f".resolv.conf.{os.getpid()}"
        tmp.write_text(RESOLV_CONF_TEXT)
        os.chmod(tmp, 0o644)
        try:
            os.link(tmp, self.resolv_conf)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()

    def for_job(self, asked: str | None) -> Mode:
        """The network of one job: none when it asks for none, else the pool's."""
        return "none" if asked == "none" else self.mode

    @property
    def resolv_conf(self) -> Path | None:
        return self.net_dir / "resolv.conf" if self.net_dir is not None else None

    def plan(self, *, build: bool = False) -> dict[str, object]:
        """What the forked child needs to enter an isolated network (`enter_isolated`): a
        job's, or with `build` an environment build's (the package indexes reachable too)."""
        return {"slirp4netns": self.slirp4netns, "blocked": list(self.blocked),
                "allowed": list(self.indexes) if build else []}


def index_hosts(environ: Mapping[str, str]) -> list[str]:
    """The hosts of the operator's package indexes, from uv's settings in `environ`."""
    hosts = []
    for var in UV_INDEX_VARS:
        for word in environ.get(var, "").replace(",", " ").split():
            url = word.partition("=")[2] if "=" in word.split("://", 1)[0] else word
            try:
                host = urlsplit(url).hostname
            except ValueError:
                continue
            if host and urlsplit(url).scheme in ("http", "https"):
                hosts.append(host)
    return list(dict.fromkeys(hosts))


def blocked_networks(settings: Settings) -> tuple[str, ...]:
    """Every network an isolated job may not reach: the fixed list, the host's own addresses
    and the pool's service addresses."""
    nets = [ipaddress.ip_network(n) for n in BLOCKED_NETWORKS]
    nets += host_addresses()
    nets += [ipaddress.ip_network(f"{a}/32") for a in _resolve(service_hosts(settings))]
    out: list[str] = []
    for net in nets:
        if net.version == 4 and not any(net != o and net.subnet_of(o) for o in nets
                                        if o.version == 4):
            out.append(str(net))
    return tuple(dict.fromkeys(out))


def service_hosts(settings: Settings) -> list[str]:
    """The hosts of the pool's own services, from its settings."""
    urls = [*settings.redis_url.split(";"), settings.database_url, settings.s3_endpoint_url]
    hosts = [settings.api_host, settings.flower_host]
    for url in urls:
        try:
            host = urlsplit(url.strip()).hostname if url.strip() else None
        except ValueError:
            continue
        if host:
            hosts.append(host)
    return [h for h in dict.fromkeys(hosts) if h not in ("", "0.0.0.0", "::")]


def host_addresses() -> list[ipaddress.IPv4Network]:
    """This host's own IPv4 addresses (`ip -j -4 addr`), each as a /32: a service bound to
    0.0.0.0 listens on every one of them. (Other hosts of its networks are the pool's
    service addresses, or private networks, or the internet.)"""
    ip = shutil.which(IP)
    if not ip:
        return []
    try:
        shown = subprocess.run([ip, "-j", "-4", "addr", "show"], capture_output=True,
                               text=True, timeout=RESOLVE_TIMEOUT_S, check=True).stdout
        links = json.loads(shown)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        log.warning("host_networks_unknown: %s", exc)
        return []
    nets = []
    for link in links:
        for addr in link.get("addr_info", []):
            try:
                nets.append(ipaddress.IPv4Network(f"{addr['local']}/32"))
            except (KeyError, ValueError):
                continue
    return nets


def _resolve(hosts: Iterable[str]) -> list[str]:
    addresses: list[str] = []
    for host in hosts:
        try:
            infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
        except OSError as exc:
            log.warning("service_address_unknown host=%s: %s", host, exc)
            continue
        addresses += [str(info[4][0]) for info in infos]
    return addresses
