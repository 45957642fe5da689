"""A job's own network (`job_network`, `e31_worker.attempt.network`; docs/security.md, "A job's
own network") with real processes: bubblewrap, slirp4netns, a network namespace standing for
the internet (`tests.internet`), listeners on this host's loopback and on its own address.

The default, `isolated`, must reach the internet and nothing of the host or the pool; the same
job on a pool set to `host` reaches the host's loopback, which shows that the attack is real.
Cold starts (bubblewrap) and warm starts (forked from the warm process) are both tried.
Skipped, saying why, where this machine cannot give a sandbox, slirp4netns or namespaces."""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e31.core.records import Claim, Outcome
from e31.core.spec import JobSpec
from e31.core.states import AttemptReason
from e31.edge.settings import Settings
from e31_worker.attempt.network import BLOCKED_NETWORKS, JobNetwork, host_addresses
from e31_worker.attempt.plan import AttemptPlan, Directive
from e31_worker.attempt.sandbox import Sandbox, network_unavailable, sandbox_unavailable
from e31_worker.attempt.supervisor import Supervisor
from e31_worker.attempt.warm import WarmStarter, warm_env
from e31_worker.child.netns import enter_isolated
from tests.internet import Internet

TENANT = "t-0123456789ab"
READY_S = 300
METADATA = ("169.254.169.254", 80)   # the cloud's metadata service, link-local
NETJOBS = '''
import json, socket

def reach(ctx, targets):
    """Connect to each (host, port): 'connected', or the error's name (and errno)."""
    out = {}
    for host, port in targets:
        try:
            s = socket.create_connection((host, port), timeout=3)
        except OSError as exc:
            out[f"{host}:{port}"] = f"{type(exc).__name__} {exc.errno}"
            continue
        with s:
            s.settimeout(1)
            try:
                said = s.recv(64).decode(errors="replace")
            except OSError:
                said = ""   # connected; the server says nothing
        out[f"{host}:{port}"] = "connected " + said
    return out
'''
REACH = NETJOBS + '''
import sys
print(json.dumps(reach(None, json.loads(sys.argv[1]))))
'''


@pytest.fixture
def listener() -> Iterator[int]:
    """A port on every address of this host (0.0.0.0): its loopback and its own addresses,
    as a pool service bound to all of them listens; it greets whoever connects."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("0.0.0.0", 0))
        server.listen(16)
        server.settimeout(0.2)
        yield server.getsockname()[1]


def own_address() -> str:
    """An address of this host other than its loopback."""
    found = [str(n.network_address) for n in host_addresses()
             if not n.network_address.is_loopback and not str(n).startswith("198.51.100.")]
    if not found:
        pytest.skip("this host has no address but its loopback")
    return found[0]


@pytest.fixture(scope="module")
def netjobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    jobs = tmp_path_factory.mktemp("netjobs")
    jobs.chmod(0o755)
    (jobs / "netjobs.py").write_text(NETJOBS)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", str(jobs), prepend=os.pathsep)
        yield jobs


@pytest.fixture(scope="module")
def warm(netjobs: Path) -> Iterator[WarmStarter]:
    w = WarmStarter(env=warm_env(os.environ))
    w.start()
    assert w.wait_ready(READY_S), "the warm process did not start"
    yield w
    w.close()


class Pool:
    """A sandboxed worker's pieces with one `job_network`, running job specs in them."""

    def __init__(self, tmp_path: Path, job_network: str, warm: WarmStarter | None = None) -> None:
        self.home = tmp_path / f"home-{job_network}"
        self.home.mkdir(mode=0o700)
        self.settings = Settings.load({"home": str(self.home), "job_network": job_network},
                                      environ={})
        why = sandbox_unavailable(self.settings) or network_unavailable(self.settings)
        if why is not None:
            pytest.skip(f"no sandbox with a network of its own here: {why}")
        self.sandbox = Sandbox.from_settings(self.settings)
        self.warm = warm
        self.n = 0

    def run(self, targets: list[tuple[str, int]]) -> tuple[Outcome, dict[str, str]]:
        self.n += 1
        job_id = f"j-net{self.n}"
        spec: dict[str, Any] = ({"entrypoint": "netjobs:reach", "params": {"targets": targets}}
                                if self.warm else
                                {"command": [sys.executable, "-c", REACH, json.dumps(targets)]})
        plan = AttemptPlan(job_id=job_id, attempt=1, spec=JobSpec.parse(spec), gpus="",
                           root=self.settings.resolved_work_dir / job_id / "attempt-1",
                           kill_grace_s=1.0, log_max_bytes=1 << 20, tick_interval_s=0.1)
        claim = Claim(job_id=job_id, tenant_id=TENANT, token=1, attempt=1, spec=plan.spec, gpus=0)
        starts: list[Any] = []
        outcome = Supervisor(plan, tick=lambda _: Directive.CONTINUE,
                             sandbox=self.sandbox.for_attempt(claim), warm=self.warm,
                             on_start=lambda ms, how: starts.append(how)).run()
        assert outcome.reason is AttemptReason.SUCCEEDED, plan.log_path.read_text()
        if self.warm is not None:
            assert [s.value for s in starts] == ["warm"], plan.log_path.read_text()
            return outcome, outcome.result
        return outcome, json.loads(plan.log_path.read_text().splitlines()[-1])


def targets(internet: Internet, port: int) -> list[tuple[str, int]]:
    return [(internet.address, internet.port), ("127.0.0.1", port), (own_address(), port),
            METADATA, ("10.1.2.3", 80)]


def refused(said: str) -> bool:
    return not said.startswith("connected")


def test_an_isolated_job_reaches_the_internet_and_nothing_of_the_host_or_its_networks(
        tmp_path: Path, internet: Internet, listener: int) -> None:
    # Given a pool on the default network, a server on the internet, and a service of this
    # host listening on its loopback and its own address
    pool = Pool(tmp_path, "isolated")
    assert pool.settings.job_network == Settings().job_network == "isolated"

    # When a job connects to each, and to the metadata service and a private address
    _, seen = pool.run(targets(internet, listener))

    # Then it reaches the internet only
    reaches_the_internet_only(seen, internet, listener)


def test_a_warm_started_isolated_job_reaches_the_internet_only_too(
        tmp_path: Path, internet: Internet, listener: int, warm: WarmStarter) -> None:
    # Given the same pool whose jobs are forked from its warm process
    pool = Pool(tmp_path, "isolated", warm)

    # When the same job, warm-started, connects to the same places
    _, seen = pool.run(targets(internet, listener))

    # Then it reaches the internet only
    reaches_the_internet_only(seen, internet, listener)


def reaches_the_internet_only(seen: dict[str, str], internet: Internet, listener: int) -> None:
    assert seen[f"{internet.address}:{internet.port}"] == "connected hello from the internet\n"
    for target in (f"127.0.0.1:{listener}", f"{own_address()}:{listener}",
                   "169.254.169.254:80", "10.1.2.3:80"):
        assert refused(seen[target]), seen


def test_the_same_job_on_a_pool_of_job_network_host_reaches_the_hosts_loopback(
        tmp_path: Path, internet: Internet, listener: int) -> None:
    # Given a pool whose operator chose the host's network for its jobs
    pool = Pool(tmp_path, "host")

    # When the same job connects to the same places
    _, seen = pool.run(targets(internet, listener))

    # Then it reaches this host's loopback and own address as well: what isolation refuses is
    # really there to be reached
    assert seen[f"127.0.0.1:{listener}"].startswith("connected")
    assert seen[f"{own_address()}:{listener}"].startswith("connected")
    assert seen[f"{internet.address}:{internet.port}"].startswith("connected")


def test_an_isolated_job_cannot_change_its_routes_and_leaves_no_helper_behind(
        tmp_path: Path) -> None:
    # Given a pool on the default network
    pool = Pool(tmp_path, "isolated")
    script = ("import socket, subprocess, sys\n"
              "server = socket.create_server(('127.0.0.1', 0))\n"
              "socket.create_connection(server.getsockname(), timeout=3).close()\n"
              "print('its own loopback answers')\n"
              "done = subprocess.run(['ip', 'route', 'del', 'unreachable', '169.254.0.0/16'],"
              " capture_output=True, text=True)\n"
              "print(done.returncode, done.stderr.strip())\n"
              "print(open('/etc/resolv.conf').read().strip())")
    plan = AttemptPlan(job_id="j-routes", attempt=1,
                       spec=JobSpec.parse({"command": [sys.executable, "-c", script]}), gpus="",
                       root=pool.settings.resolved_work_dir / "j-routes" / "attempt-1",
                       kill_grace_s=1.0, log_max_bytes=1 << 20, tick_interval_s=0.1)
    claim = Claim(job_id="j-routes", tenant_id=TENANT, token=1, attempt=1, spec=plan.spec,
                  gpus=0)

    # When the job tries to remove the route that refuses the metadata service
    outcome = Supervisor(plan, tick=lambda _: Directive.CONTINUE,
                         sandbox=pool.sandbox.for_attempt(claim)).run()

    # Then it may not (it has no capability in its namespace), while its own loopback works;
    # its names go to slirp4netns's forwarder, and no slirp4netns of it outlives it (the
    # autouse fixture checks processes)
    assert outcome.reason is AttemptReason.SUCCEEDED
    said = plan.log_path.read_text().splitlines()
    assert said[-3] == "its own loopback answers", said
    assert said[-2].split()[0] != "0" and "not permitted" in said[-2], said
    assert said[-1] == "nameserver 10.0.2.3"


def test_the_blocked_networks_hold_the_hosts_own_addresses_and_the_pools_services(
        tmp_path: Path) -> None:
    # Given a pool whose Redis and store live on hosts of a public network
    settings = Settings.load({"home": str(tmp_path), "redis_url": "redis://203.0.113.7:6379/0",
                              "database_url": "postgresql://e31@203.0.113.8/e31"}, environ={})

    # Then an isolated job's routes refuse them, the host's own addresses, and the fixed list
    blocked = JobNetwork.from_settings(settings).blocked
    assert "203.0.113.7/32" in blocked and "203.0.113.8/32" in blocked
    assert set(BLOCKED_NETWORKS) <= set(blocked)
    for own in host_addresses():
        assert any(own.subnet_of(ipaddress.IPv4Network(b)) for b in blocked)


def test_a_worker_refuses_to_start_without_user_mode_networking(
        tmp_path: Path, request: pytest.FixtureRequest) -> None:
    # Given a host whose PATH has bubblewrap and ip but no slirp4netns (in a directory the
    # sandbox's uid may enter: bubblewrap runs as that uid)
    bin_dir = Path(tempfile.mkdtemp(prefix="e31-nonet-"))
    bin_dir.chmod(0o755)
    request.addfinalizer(lambda: shutil.rmtree(bin_dir, ignore_errors=True))
    for tool in ("bwrap", "ip"):
        found = subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True,
                               text=True).stdout.strip()
        if found:
            (bin_dir / tool).symlink_to(found)
    env = dict(os.environ, PATH=str(bin_dir), E31_HOME=str(tmp_path / "home"),
               E31_REDIS_URL="redis://127.0.0.1:1/0", E31_ISOLATION="sandbox")
    env.pop("E31_JOB_NETWORK", None)

    # When a worker starts with the default network
    done = subprocess.run([sys.executable, "-m", "e31.cli", "worker", "--cpu-slots", "1",
                           "--gpus", ""], env=env, capture_output=True, text=True, timeout=120)

    # Then it refuses, saying what to install and what the alternative is
    said = done.stdout + done.stderr
    if "cannot run jobs in a sandbox" in said:
        pytest.skip(f"no sandbox here: {said.strip()[-300:]}")
    assert done.returncode != 0
    assert "slirp4netns" in said and "apt-get install" in said, said
    assert "E31_JOB_NETWORK=host" in said


def test_a_builds_namespace_routes_the_operators_private_index_and_refuses_its_neighbours(
        tmp_path: Path) -> None:
    # Given a pool whose package index lives on a private address, named in uv's settings
    settings = Settings.load({"home": str(tmp_path / "home")}, environ={})
    network = JobNetwork.from_settings(
        settings, environ={"UV_INDEX_URL": "https://10.9.8.7/simple",
                           "UV_INDEX": "internal=http://10.9.8.6:3141/root/pypi",
                           "UV_FIND_LINKS": "/opt/wheels"})
    if network.unavailable() is not None or os.geteuid() != 0:
        pytest.skip(f"no isolated network here: {network.unavailable() or 'not root'}")
    assert set(network.indexes) == {"10.9.8.7", "10.9.8.6"}

    # When a build's namespace and a job's are entered, and asked where those addresses go
    def routes(build: bool) -> str:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:   # the child enters the namespace and reports its kernel's routes
            try:
                enter_isolated(network.plan(build=build))
                said = subprocess.run(["ip", "route", "get", "10.9.8.7"], capture_output=True,
                                      text=True)
                os.write(w, (said.stdout + said.stderr).encode())
                said = subprocess.run(["ip", "route", "get", "10.9.8.8"], capture_output=True,
                                      text=True)
                os.write(w, (said.stdout + said.stderr).encode())
            finally:
                os._exit(0)
        os.close(w)
        with os.fdopen(r) as f:
            out = f.read()
        os.waitpid(pid, 0)
        return out

    build, job = routes(True), routes(False)

    # Then the build reaches the index through slirp4netns, not its neighbour; a job neither
    assert "10.9.8.7 via 10.0.2.2" in build, build
    assert "10.9.8.8 via" not in build and build.count("No route to host") == 1, build
    assert "via 10.0.2.2" not in job and job.count("No route to host") == 2, job


def test_e31_up_without_user_mode_networking_warns_and_shares_the_network_unless_told(
        tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import typer

    from e31.cli.stack import _isolation
    # Given a machine with bubblewrap but no slirp4netns
    bin_dir = Path(tempfile.mkdtemp(prefix="e31-nonet-"))
    bin_dir.chmod(0o755)
    request.addfinalizer(lambda: shutil.rmtree(bin_dir, ignore_errors=True))
    (bin_dir / "bwrap").symlink_to(shutil.which("bwrap") or "/usr/bin/bwrap")
    monkeypatch.setenv("PATH", str(bin_dir))
    # set, then removed: monkeypatch records the variable's state before the test only when
    # it exists, and `_isolation` below sets it in this process; without the record, the
    # test's end restored its "host" to every later test's stacks
    monkeypatch.setenv("E31_JOB_NETWORK", "")
    monkeypatch.delenv("E31_JOB_NETWORK")
    settings = Settings.load({"home": str(tmp_path / "home")}, environ={})
    if sandbox_unavailable(settings.model_copy(update={"job_network": "host"})):
        pytest.skip("no sandbox here")

    # When `e31 up` picks its isolation without a flag: the sandbox, on the machine's network,
    # said on stderr, and its workers told so
    assert _isolation(settings, chosen=False) == "sandbox"
    assert os.environ["E31_JOB_NETWORK"] == "host"
    assert "warning: jobs share this machine's network" in " ".join(capsys.readouterr().err.split())

    # But asked for the sandbox by flag, it refuses, saying what to install
    monkeypatch.delenv("E31_JOB_NETWORK")
    with pytest.raises(typer.Exit):
        _isolation(settings, chosen=True)
    assert "apt-get install slirp4netns" in " ".join(capsys.readouterr().err.split())
