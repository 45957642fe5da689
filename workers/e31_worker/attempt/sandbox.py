"""The sandbox an attempt's child runs in (docs/security.md): its own user, namespaces and files.

With `isolation = "sandbox"` (the default) the worker, which runs as root, starts each job as

    fork → enter the attempt's memory cgroup → [stage binds] → drop to the job's uid → exec
    bwrap --unshare-all [--share-net] --die-with-parent --new-session <binds> -- <job argv>

so the job runs as an unprivileged uid of its tenant (`sandbox_uid_base` + a stable hash of
the tenant id modulo `sandbox_uid_count`; no host user may own these uids), in its own user,
mount, PID, IPC, UTS and cgroup namespaces (bubblewrap makes them; with `network: none` a
network namespace too, which holds only a loopback of its own). What it sees of the host's
files: the system and the worker's Python read-only (`/usr`, `/etc`, the `/lib*`, `/bin`,
`/sbin`, the interpreter's prefixes, site directories and the worker's PYTHONPATH), a fresh
`/proc` of its own PID namespace, a minimal `/dev` (plus the NVIDIA driver's nodes and the
`/dev/nvidiaN` of the GPUs it holds, no other GPU's, and `/sys` read-only on a GPU host),
private `/tmp` and `/dev/shm`, and its attempt's directory read-write. Where its GPUs' device
nodes are there (a real GPU host), CUDA sees only those, numbered from 0 as in a container or
under SLURM's ConstrainDevices, so its CUDA_VISIBLE_DEVICES says `0,1,…` and `E31_GPUS` the
host's indexes; with simulated GPUs (no nodes) CUDA_VISIBLE_DEVICES keeps the host's indexes.
Its network is `e31_worker.attempt.network`'s. Its code bundle and its environment are
bound read-only. `E31_HOME`, the store, the artifact store, other attempts' directories, the
Redis password file and the worker's processes do not exist for it: a protected path inside a
directory bound for the system is hidden under an empty tmpfs.

The environment it starts with is exactly the one the supervisor built for it (what the
allowlist of `e31_worker.attempt.jobenv` and `job_env_passthrough` keep of the worker's
variables, never a credential nor an `E31_*` setting; the spec's `env`; the job's own `E31_*`
paths): that
is bubblewrap's whole environment, so `--clearenv` is not needed, and no value appears on a
command line. `HOME` is the job's scratch directory, unless the spec set one.

Files. Before the start the attempt's root (`<work_dir>/<job>/attempt-<n>`) becomes
`root:<job gid>` mode 1770: the job may create files there (its `progress.json`, and the
runner's `result.json` / `error.json`), but the sticky bit keeps it from removing or
replacing the worker's own (`claim.json`, `job.json`, `attempt.log`, all root's). Its `work`,
`output`, `checkpoints` and `inputs` trees are chowned to the job's uid. The worker reads
what a job wrote without following a link and only from a regular file (`read_job_file`),
and the artifact store refuses links in outputs and checkpoints.

What is bound, and how a source the job's uid could not reach on the host is staged first,
is `e31_worker.attempt.binds`.

Stopping. bubblewrap's outer process is the supervisor's process group; the job runs in a
new session inside the PID namespace, whose init is bubblewrap's. SIGTERM therefore goes to
every process of the namespace but its init (`signal_job`), and SIGKILL to bubblewrap, whose
death kills the namespace's init (`--die-with-parent`), which makes the kernel kill every
process in it. bubblewrap reports a job killed by signal N as exit status 128 + N
(`exit_code` turns it back into -N, as for a process isolated job).

How the attempt was isolated and started (`isolation`, `start`: `warm` when forked from the
worker's warm process, `e31_worker.attempt.warm`, which enters this same view after the fork,
and `start_ms`) is noted on it by the isolation stage (`e31_worker.attempt.isolation`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from e31.core.errors import ConfigError
from e31.core.records import Claim
from e31.edge.settings import Settings
from e31_worker.attempt.binds import (
    SYSTEM_PATHS,
    exposes,
    outermost,
    protected_paths,
    python_paths,
    source,
)
from e31_worker.attempt.jobenv import inherited_env
from e31_worker.attempt.network import JobNetwork, Mode
from e31_worker.child.spawner import enter_from, network_from

log = logging.getLogger(__name__)

BWRAP = "bwrap"
GPU_DEVICE_PREFIX = "nvidia"   # /dev/nvidia0.., nvidiactl, nvidia-uvm, nvidia-caps/
DEV_DIR = Path("/dev")
DRIVER_GPUS = Path("/proc/driver/nvidia/gpus")  # <bus id>/information: "Device Minor: N"
_GPU_NODE = re.compile(GPU_DEVICE_PREFIX + r"(\d+)")
_DEVICE_MINOR = re.compile(r"^Device Minor:\s*(\d+)", re.MULTILINE)
SIGNAL_EXIT_BASE = 128         # bubblewrap's exit status for a job killed by signal N: 128 + N
ROOT_MODE = 0o1770             # the attempt root: root:<job gid>, sticky
WORKER_FILES = ("attempt.log", "claim.json")  # the worker's files in the root: never the job's
PROBE_TIMEOUT_S = 60.0         # the start-up check: one sandboxed Python that imports the runner
JOB_FILE_MAX_BYTES = 64 * 1024 ** 2  # a result or progress file the worker reads back
RESOLV_CONF = "/etc/resolv.conf"  # an isolated job's names the slirp4netns forwarder answers

@dataclass(frozen=True)
class Launch:
    """How a sandboxed child starts: this argv and environment, and what the forked child
    does as root right before it execs, as data (`spec`: its uid, the sources to stage, the
    isolated network's plan or None), which the spawner takes as it is
    (`e31_worker.child.spawner`) and `enter` resolves for a fork in this process."""

    argv: list[str]
    env: dict[str, str]
    spec: dict[str, Any]

    def enter(self) -> Callable[[], None]:
        """The child's `enter` (enter the network, stage the binds, drop to the uid),
        resolved now, before the fork: a `preexec_fn` of a child that joins no cgroup."""
        network, become = network_from(self.spec), enter_from(self.spec)
        assert become is not None   # a launch always has its uid
        if network is None:
            return become

        def enter() -> None:
            network()
            become()

        return enter


class Sandbox:
    """What every sandbox of one worker process shares: bubblewrap, the uid range, the paths
    every job reads, and the paths no job may see. Built once (`from_settings`); each attempt
    gets its own `AttemptSandbox` (`for_attempt`)."""

    def __init__(self, *, bwrap: str, uid_base: int, uid_count: int,
                 read_only: Sequence[Path], writable: Sequence[Path],
                 protected: Sequence[Path], network: JobNetwork | None = None) -> None:
        self.bwrap = bwrap
        self.network = network if network is not None else JobNetwork(mode="host")
        self.dev_dir = DEV_DIR            # where the GPUs' device nodes are (a test's stand-in)
        self.driver_dir = DRIVER_GPUS
        self._uid_base = uid_base
        self._uid_count = uid_count
        self._protected = tuple(protected)
        self._read_only = tuple(read_only)
        self._writable = tuple(writable)
        # What every attempt's view shares, decided once (path arithmetic was a tenth of the
        # worker's CPU per attempt, issue 31): the read-only trees to bind, and the protected
        # paths inside what is shown (hidden in each view while they exist).
        self._read_only_outer = tuple(outermost(self._read_only))
        shown = [*map(Path, SYSTEM_PATHS), *self._read_only]
        self._hidden = tuple(h for h in self._protected
                             if any(h.is_relative_to(p) for p in shown))

    @classmethod
    def from_settings(cls, settings: Settings) -> Sandbox:
        """The worker's sandbox: the system, its Python and the operator's shared directories
        visible; its home, store, artifacts, work dir and secrets never."""
        protected = protected_paths(settings)
        operator = [Path(p) for p in (*settings.sandbox_read_only_dirs,
                                      *settings.sandbox_writable_dirs)]
        for path in operator:
            if (why := exposes(path, protected)) is not None:
                raise ConfigError(f"sandbox directory {path} {why}: no job may see it")
        base = [p for p in python_paths() if exposes(p, protected) is None]
        network = JobNetwork.from_settings(settings)
        network.prepare()   # the routes and resolv.conf its isolated namespaces use
        return cls(bwrap=shutil.which(BWRAP) or "", uid_base=settings.sandbox_uid_base,
                   uid_count=settings.sandbox_uid_count,
                   read_only=[*base, *(Path(p) for p in settings.sandbox_read_only_dirs)],
                   writable=[Path(p) for p in settings.sandbox_writable_dirs],
                   protected=protected, network=network)

    def uid_for(self, tenant_id: str) -> int:
        """The tenant's uid (and gid): the same on every host and after every restart."""
        digest = hashlib.sha256(tenant_id.encode()).digest()
        return self._uid_base + int.from_bytes(digest[:8], "big") % self._uid_count

    def for_attempt(self, claim: Claim) -> AttemptSandbox:
        """The sandbox of a claimed attempt: its tenant's uid, and the pool's network unless
        it asks for none."""
        return AttemptSandbox(self, uid=self.uid_for(claim.tenant_id),
                              network=self.network.for_job(claim.spec.network))

    def unavailable(self, work_dir: Path) -> str | None:
        """Why no job can run in this sandbox here, or None: root, bubblewrap and user
        namespaces are checked by running one sandboxed Python that imports the job runner,
        as a job would (under `work_dir`, as root, then removed), in the pool's job network."""
        if os.geteuid() != 0:
            return ("the worker does not run as root, so it cannot start jobs as other users "
                    "(run it as root, or start it with --isolation process)")
        if not self.bwrap:
            return "bubblewrap is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
        work_dir.mkdir(parents=True, exist_ok=True)
        root = Path(tempfile.mkdtemp(prefix=".sandbox-probe-", dir=work_dir))
        try:
            (root / "work").mkdir()
            probe = AttemptSandbox(self, uid=self.uid_for("probe"), network=self.network.mode)
            launch = probe.launch(
                [sys.executable, "-c", "import e31_worker.child.runner"],
                inherited_env(os.environ), root=root,   # a job's environment: its PYTHONPATH
                cwd=root / "work", writable=[root / "work"], read_only=[])
            done = subprocess.run(launch.argv, env=launch.env, cwd=root / "work",
                                  preexec_fn=launch.enter(), stdin=subprocess.DEVNULL,
                                  capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as exc:
            return f"cannot start bubblewrap: {exc}"
        finally:
            shutil.rmtree(root, ignore_errors=True)
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip().splitlines()
            return (f"a sandboxed test process failed (exit {done.returncode}): "
                    f"{said[-1] if said else 'no output'}; user namespaces may be off "
                    "(sysctl kernel.unprivileged_userns_clone, user.max_user_namespaces) or a "
                    "container's seccomp/AppArmor profile may forbid them (docs/operations.md)")
        return None

    def bind_args(self, uid: int, *, staged: list[Path] | None,
                  gpus: Sequence[int] = ()) -> list[str]:
        """The arguments for the system, the Python and the operator's directories, with the
        protected paths they contain hidden, and the device nodes of the GPUs `gpus` (by
        index); sources the uid cannot reach go into `staged`."""
        # Fresh /proc, /dev, /tmp and /dev/shm first: binds below them (a module directory in
        # /tmp on a worker's PYTHONPATH, a GPU's device node) go on top.
        args = ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", "/dev/shm"]
        for path in map(Path, SYSTEM_PATHS):
            if path.is_symlink():
                args += ["--symlink", os.readlink(path), str(path)]
            elif path.exists():
                args += ["--ro-bind", source(path, uid, staged), str(path)]
        for path in self._read_only_outer:
            args += ["--ro-bind", source(path, uid, staged), str(path)]
        for hidden in self._hidden:
            if hidden.exists():
                args += (["--tmpfs", str(hidden)] if hidden.is_dir()
                         else ["--ro-bind", "/dev/null", str(hidden)])
        devices = gpu_device_args(gpus, dev_dir=self.dev_dir, driver_dir=self.driver_dir)
        args += devices
        if devices:  # the driver's libraries read the GPUs' PCI details there, as in a container
            args += ["--ro-bind-try", "/sys", "/sys"]
        for path in self._writable:
            args += ["--bind", source(path, uid, staged), str(path)]
        return args


class AttemptSandbox:
    """One attempt's sandbox: its tenant's uid, and its network (`e31_worker.attempt.network`)."""

    def __init__(self, sandbox: Sandbox, *, uid: int, network: Mode) -> None:
        self._sandbox = sandbox
        self.uid = uid
        self.network = network

    def launch(self, argv: Sequence[str], env: Mapping[str, str], *, root: Path, cwd: Path,
               writable: Iterable[Path], read_only: Iterable[Path]) -> Launch:
        """Hand the attempt's directories to the job's uid and wrap `argv` in bubblewrap.

        `root` (the attempt's directory) is bound read-write, the trees in `writable` (inside
        it) become the job's, and `read_only` (its code, its environment) is bound read-only.
        """
        self._own(root, writable)
        staged: list[Path] = []
        args = [self._sandbox.bwrap, "--unshare-all", "--die-with-parent", "--new-session"]
        if self.network != "none":   # the host's, or the isolated one `enter` moves into
            args.append("--share-net")
        args += self._view(root, read_only, staged, env)
        args += ["--chdir", str(cwd), "--", *argv]
        net = self._sandbox.network.plan() if self.network == "isolated" else None
        return Launch(argv=args, env=self._env(env, home=root / "work"),
                      spec={"uid": self.uid, "staged": [str(p) for p in staged], "net": net})

    def net_plan(self) -> dict[str, object] | None:
        """For a warm start: what its outer process needs to enter the isolated network."""
        return self._sandbox.network.plan() if self.network == "isolated" else None

    def warm_view(self, env: Mapping[str, str], *, root: Path, writable: Iterable[Path],
                  read_only: Iterable[Path]) -> tuple[list[str], dict[str, str]]:
        """For a warm start (`e31_worker.child.zygote`): the same view as `launch` gives
        bubblewrap, as its bind arguments from the real sources (the forked child binds them
        while still root, so nothing is staged), and the same environment."""
        self._own(root, writable)
        return self._view(root, read_only, None, env), self._env(env, home=root / "work")

    def _view(self, root: Path, read_only: Iterable[Path], staged: list[Path] | None,
              env: Mapping[str, str]) -> list[str]:
        args = self._sandbox.bind_args(self.uid, staged=staged, gpus=held_gpus(env))
        resolv = self._sandbox.network.resolv_conf
        if self.network == "isolated" and resolv is not None and Path(RESOLV_CONF).exists():
            args += ["--ro-bind", source(resolv, self.uid, staged), RESOLV_CONF]
        args += ["--bind", source(root, self.uid, staged), str(root)]
        for path in outermost(p for p in read_only if p.exists()):
            args += ["--ro-bind", source(path, self.uid, staged), str(path)]
        return args

    def _own(self, root: Path, writable: Iterable[Path]) -> None:
        """The root to root:<gid> 1770 (the worker's files in it stay the worker's), the
        writable trees to the job's uid, before any of its code runs."""
        for name in WORKER_FILES:  # made now, so the job cannot plant them
            fd = os.open(root / name, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600)
            os.fchmod(fd, 0o600)
            os.close(fd)
        os.chown(root, os.geteuid(), self.uid, follow_symlinks=False)
        os.chmod(root, ROOT_MODE)
        for tree in writable:
            if not tree.is_dir() or tree.is_symlink():
                continue
            os.chown(tree, self.uid, self.uid, follow_symlinks=False)
            for top, dirs, files in os.walk(tree):
                for name in (*dirs, *files):
                    os.chown(os.path.join(top, name), self.uid, self.uid, follow_symlinks=False)

    def _env(self, env: Mapping[str, str], *, home: Path) -> dict[str, str]:
        """The job's environment with the worker's own HOME and user name replaced, and its
        GPUs numbered as the job sees them when only their device nodes are there."""
        out = dict(env)
        held = held_gpus(env)
        minors = gpu_minors(self._sandbox.driver_dir)
        if held and all((self._sandbox.dev_dir / f"{GPU_DEVICE_PREFIX}{minors.get(i, i)}")
                        .exists() for i in held):
            out["CUDA_VISIBLE_DEVICES"] = ",".join(str(sorted(held).index(i)) for i in held)
            out["E31_GPUS"] = env["CUDA_VISIBLE_DEVICES"]
        if out.get("HOME") in (None, os.environ.get("HOME")):
            out["HOME"] = str(home)
        for var in ("USER", "LOGNAME"):
            if out.get(var) == os.environ.get(var):
                out[var] = f"e31-{self.uid}"
        return out


def held_gpus(env: Mapping[str, str]) -> list[int]:
    """The host's indexes of the GPUs an attempt holds, from its CUDA_VISIBLE_DEVICES."""
    return [int(i) for i in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if i.isdigit()]


def gpu_minors(driver_dir: Path = DRIVER_GPUS) -> dict[int, int]:
    """Each GPU's device minor (its /dev/nvidiaN) by its index in PCI bus order (the order
    of CUDA_DEVICE_ORDER=PCI_BUS_ID and of the worker's GPU indexes), from the driver's
    /proc/driver/nvidia/gpus/<bus id>/information; empty where there is no driver (then a
    GPU's minor is taken to be its index)."""
    minors: dict[int, int] = {}
    try:
        buses = sorted(p for p in driver_dir.iterdir() if p.is_dir())
    except OSError:
        return minors
    for index, bus in enumerate(buses):
        try:
            match = _DEVICE_MINOR.search((bus / "information").read_text())
        except OSError:
            continue
        if match:
            minors[index] = int(match.group(1))
    return minors


def gpu_device_args(gpus: Sequence[int], *, dev_dir: Path = DEV_DIR,
                    driver_dir: Path = DRIVER_GPUS) -> list[str]:
    """bubblewrap's arguments for the NVIDIA device nodes a job gets: the driver's own
    (nvidiactl, nvidia-uvm, nvidia-uvm-tools, nvidia-modeset, nvidia-caps/) and the
    /dev/nvidiaN of the GPUs it holds, no other GPU's."""
    minors = gpu_minors(driver_dir)
    wanted = {minors.get(i, i) for i in gpus}
    args: list[str] = []
    for device in sorted(dev_dir.glob(GPU_DEVICE_PREFIX + "*")):
        match = _GPU_NODE.fullmatch(device.name)
        if match and int(match.group(1)) not in wanted:
            continue
        args += ["--dev-bind-try", str(device), f"/dev/{device.name}"]
    return args


def signal_job(bwrap_pid: int, sig: int) -> None:
    """Send `sig` to a sandboxed job started as `bwrap_pid`: SIGKILL to bubblewrap and its
    namespace's init (which takes every process of the namespace with it); any other signal
    to every process of the namespace but its init, which would drop it anyway."""
    init = _namespace_init(bwrap_pid)
    if sig == signal.SIGKILL:
        targets = [bwrap_pid, *([init] if init else [])]
    else:
        targets = _namespace_members(init) if init else []
    for pid in targets:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def exit_code(code: int) -> int:
    """A sandboxed job's exit status as a process isolated job's: -N for killed by signal N."""
    if SIGNAL_EXIT_BASE < code <= SIGNAL_EXIT_BASE + signal.NSIG:
        return -(code - SIGNAL_EXIT_BASE)
    return code


def read_job_file(path: Path, *, max_bytes: int = JOB_FILE_MAX_BYTES) -> bytes | None:
    """A file a job wrote into its attempt's directory, read back by the worker: only a
    regular file, never through a link, never a FIFO that would block; None when there is
    none. Larger than `max_bytes`: `ValueError`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:  # absent, a link (ELOOP), or unreadable: nothing the job finished
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        if st.st_size > max_bytes:
            raise ValueError(f"{path.name} is larger than {max_bytes} bytes")
        return f.read(max_bytes + 1)[:max_bytes]


def _namespace_init(bwrap_pid: int) -> int | None:
    """The init of the PID namespace bubblewrap `bwrap_pid` made: its child in another PID
    namespace (an isolated job's slirp4netns is bubblewrap's child too, in the host's)."""
    try:
        children = Path(f"/proc/{bwrap_pid}/task/{bwrap_pid}/children").read_text().split()
        ours = os.readlink(f"/proc/{bwrap_pid}/ns/pid")
    except OSError:
        return None
    for child in map(int, children):
        try:
            if os.readlink(f"/proc/{child}/ns/pid") != ours:
                return child
        except OSError:
            continue
    return None


def _namespace_members(init: int) -> list[int]:
    """Every process in the PID namespace whose init is `init`, but the init; none when that
    namespace is the worker's own (never signal the host's processes)."""
    try:
        namespace = os.readlink(f"/proc/{init}/ns/pid")
        if namespace == os.readlink("/proc/self/ns/pid"):
            log.error("signal_refused init=%d: not a job's PID namespace", init)
            return []
    except OSError:
        return []
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == init:
            continue
        try:
            if os.readlink(entry / "ns" / "pid") == namespace:
                members.append(int(entry.name))
        except OSError:
            continue
    return members


def sandbox_unavailable(settings: Settings) -> str | None:
    """Why this host cannot run `settings`' jobs in a sandbox, or None: checked once when a
    worker starts (`e31 worker`, `e31 up`), by running one sandboxed process."""
    try:
        sandbox = Sandbox.from_settings(settings)
    except ConfigError as exc:
        return exc.message
    if sandbox.network.unavailable() is not None:  # said by network_unavailable
        sandbox = Sandbox.from_settings(settings.model_copy(update={"job_network": "host"}))
    return sandbox.unavailable(settings.resolved_work_dir)


def network_unavailable(settings: Settings) -> str | None:
    """Why this host cannot give sandboxed jobs the pool's `job_network`, or None: a worker
    refuses to start rather than run jobs on the host's network unasked."""
    return JobNetwork.from_settings(settings).unavailable()
