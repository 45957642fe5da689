"""The job's own Python environment (`python: {pip: [...], requirements: FILE}`): a virtual
environment built with uv over the worker's, once per host for what was asked, and reused by
every later job that asks the same (`EnvCache`; docs/jobs.md, docs/operations.md).

Layered, not copied: the job's environment sees the worker's packages (torch, numpy,
e31_worker) behind its own. It reaches the system's site-packages exactly when the worker's
interpreter does (`--system-site-packages`), and the worker's own site directories through
a `.pth` file, which also covers a worker that itself runs in a virtual environment. uv does
not count packages seen that way as installed (it would download torch again), so a build
resolves what was asked with every package of the worker pinned to the worker's version (a
constraint: a job adds packages, it never swaps one of the worker's), then installs only what
the worker lacks and the request needs other than through a package the worker has (that
package's own dependencies are the worker's, satisfied already).

Wheels only (`--no-build`): building a source distribution would run its code.

Requirements are requirements, nothing else (`e31.core.requirements`): the API refuses an option,
a path or a URL in `python.pip` or the requirements file at submit, and `EnvRequest.of` and
`UvBuild` refuse them again (a spec stored before that check) with a `SetupError` naming the
field and the line, before uv runs. The index a build uses is the operator's: uv gets it from
the worker's own uv configuration only (`UV_INDEX_URL`, `UV_EXTRA_INDEX_URL`, `UV_INDEX`,
`UV_FIND_LINKS`, `UV_CONFIG_FILE`, `/etc/uv/uv.toml`), through an allowlist of the worker's
variables (`build_env`). With `isolation = "sandbox"` the build runs in a sandbox as the
tenant's uid (`e31_worker.attempt.buildbox`); with `process`, as the worker's user.

A build that fails because the index failed in a way that may pass (a 5xx or 429, a connection
refused, reset or timed out: `transient.index_fault`, read from uv's output) is the pool's
(`SetupTransient`: `setup_transient`, retried on the pool's account); any other failure of uv
is the user's (`setup`: a requirement no index has, a version conflict).

The key hashes the normalised requirements, the requirements file's content and the worker's
environment (interpreter, site directories, every distribution and version), so a worker
upgraded in place builds anew.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import signal
import site
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from e31.core.clock import utcnow
from e31.core.errors import SetupError, SetupTransient
from e31.core.pythonenv import PythonEnv
from e31.core.requirements import REQUIREMENTS_MAX_BYTES, requirement_problem, requirements_refusals
from e31.edge.settings import Settings
from e31_worker.attempt.buildbox import BuildSandbox, operator_paths
from e31_worker.attempt.envcache import Beat, EnvCache, JobEnv
from e31_worker.attempt.plan import AttemptPlan
from e31_worker.attempt.stages import Attempt, Stage
from e31_worker.attempt.transient import index_fault
from e31_worker.attempt.watchdog import lease_beat

log = logging.getLogger(__name__)

CACHE_DIR = ".envs"            # under work_dir: one host's built environments
ENV_LAYOUT = 1                 # part of every key: a new layout never reuses an old build
BASE_PTH = "_e31_base.pth"     # in a job environment's site-packages: the worker's site dirs
OUTPUT_MAX_BYTES = 64 * 1024   # of one uv run's output, copied into the attempt's log
RESOLVED_MAX_BYTES = 16 * 1024 * 1024  # of uv's resolution: thousands of pinned packages
REFUSALS_SHOWN = 5             # refused lines a setup error names
# What a build keeps of the worker's environment: the operator's uv settings (its index among
# them), the way out (proxies, CA certificates) and the locale; nothing else (no credential,
# no E31_* setting). HOME is the build's scratch directory.
BUILD_ENV_NAMES = frozenset({
    "PATH", "LANG", "LC_ALL", "LC_CTYPE", "SSL_CERT_FILE", "SSL_CERT_DIR",
    "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY",
    "http_proxy", "https_proxy", "all_proxy", "no_proxy"})
BUILD_ENV_PREFIX = "UV_"
_VIA = re.compile(r"^(?P<req>\S.*?)\s+# via (?P<via>.*)$")


class EnvironmentStage(Stage):
    """The environment stage: the job's own environment (`python:`), built or found in this
    host's cache, held for the attempt (a held environment is never evicted) and given to its
    plan; nothing for a job that asks for none. A build runs in the tenant's build sandbox
    where the worker has a sandbox, and beats the lease while it runs."""

    def setup(self, attempt: Attempt) -> None:
        svc = attempt.svc
        env = job_environment(svc.settings, attempt.plan, beat=lease_beat(attempt.lease),
                              sandbox=(BuildSandbox.for_tenant(svc.sandbox, attempt.claim.tenant_id)
                                       if svc.sandbox else None))
        if env is not None:
            attempt.held.callback(env.release)
            attempt.plan = dataclasses.replace(attempt.plan, venv=env.path)


def job_environment(settings: Settings, plan: AttemptPlan, *, beat: Beat,
                    sandbox: BuildSandbox | None = None) -> JobEnv | None:
    """The job's own environment, built or found in this host's cache and held for the
    attempt (release it when the attempt ends); None when the spec asks for nothing (the job
    runs in the worker's). A build runs in `sandbox` (the tenant's; None: as the worker's
    user). What uv said, and whether the environment was built or reused, go to the
    attempt's log; `SetupError` when what was asked is refused or cannot be installed,
    `SetupTransient` when the package index failed in a way that may pass (`index_fault`)."""
    python = plan.spec.python
    if python is None or (not python.pip and python.requirements is None):
        return None
    started = time.monotonic()
    request = EnvRequest.of(python, plan.code_dir if plan.spec.code else None)
    base = BaseEnv.current()
    builder = UvBuild(request, base, uv=uv_binary(), log_path=plan.log_path, beat=beat,
                      beat_s=settings.heartbeat_interval_s,
                      timeout_s=settings.env_build_timeout_s, sandbox=sandbox)
    cache = EnvCache(settings.resolved_work_dir / CACHE_DIR,
                     max_bytes=settings.env_cache_max_bytes, beat_s=settings.heartbeat_interval_s)
    env = cache.acquire(cache_key(request, base), builder, beat=beat)
    setup_s = time.monotonic() - started
    how = (f"built in {setup_s:.1f} s" if env.built
           else f"cached (built {env.record.get('built_at')}; nothing built now)")
    installed = ", ".join(env.record.get("installed") or []) or "nothing beyond the worker's"
    with open(plan.log_path, "a") as out:
        out.write(f"e31: environment {env.key}: {how}; installed: {installed}\n")
    log.info("env_ready job=%s attempt=%d key=%s env=%s setup_s=%.2f", plan.job_id,
             plan.attempt, env.key, "built" if env.built else "cached", setup_s)
    return env


@dataclass(frozen=True)
class EnvRequest:
    """What a job asks for, normalised: the same request always gets the same key."""

    pip: tuple[str, ...]                 # requirement strings, normalised, sorted, unique
    requirements: str | None = None      # the requirements file's content
    requirements_name: str | None = None  # its path in the bundle, for messages

    @classmethod
    def of(cls, python: PythonEnv, code_dir: Path | None) -> EnvRequest:
        """The request of a spec's `python` field, its requirements file read from the job's
        unpacked code; `SetupError` when the file is not there or not a requirements file, or
        when an item or a line is no plain requirement (`refusal`)."""
        for i, item in enumerate(python.pip):
            if (why := requirement_problem(item)) is not None:
                raise SetupError(f"python.pip[{i}]: {item[:120]!r} {why}")
        pip = tuple(sorted({normalised(r) for r in python.pip}))
        if python.requirements is None:
            return cls(pip=pip)
        name = python.requirements
        if code_dir is None:
            raise SetupError(f"python.requirements: {name}: the job has no code")
        try:
            path = (code_dir / PurePosixPath(name)).resolve(strict=True)
            if not path.is_relative_to(code_dir.resolve()) or not path.is_file():
                raise SetupError(f"python.requirements: {name} is not a file of the job's code")
            if path.stat().st_size > REQUIREMENTS_MAX_BYTES:
                raise SetupError(f"python.requirements: {name} is larger than "
                                 f"{REQUIREMENTS_MAX_BYTES} bytes")
            text = path.read_text()
        except FileNotFoundError:
            raise SetupError(f"python.requirements: {name} is not in the job's code") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise SetupError(f"python.requirements: cannot read {name}: {exc}") from exc
        request = cls(pip=pip, requirements=text, requirements_name=name)
        if (why := request.refusal()) is not None:
            raise SetupError(why)
        return request

    def refusal(self) -> str | None:
        """Why uv may not be given this request, naming the field and the line (quoting
        nothing but the offending line of the tenant's own file), or None."""
        for item in self.pip:
            if (why := requirement_problem(item)) is not None:
                return f"python.pip: {item[:120]!r} {why}"
        if self.requirements is None:
            return None
        refused = requirements_refusals(self.requirements)
        if not refused:
            return None
        name = self.requirements_name or "the requirements file"
        more = f" (and {len(refused) - REFUSALS_SHOWN} more)" if len(refused) > REFUSALS_SHOWN \
            else ""
        return (f"python.requirements: {name}, "
                + "; ".join(str(r) for r in refused[:REFUSALS_SHOWN]) + more)


def normalised(requirement: str) -> str:
    """One spelling of a requirement: `Tomli_W == 1.2` and `tomli-w==1.2` ask the same."""
    req = Requirement(requirement)
    req.name = canonicalize_name(req.name)
    return str(req)


@dataclass(frozen=True)
class BaseEnv:
    """The worker's Python environment, which every job environment is built over."""

    executable: str
    site_dirs: tuple[str, ...]           # the worker's site directories, in its order
    system_site: bool                    # whether the worker sees the system's site-packages
    distributions: Mapping[str, str] = field(default_factory=dict)  # name -> version

    @classmethod
    def current(cls) -> BaseEnv:
        """This process's environment (the worker's)."""
        dirs = [*site.getsitepackages()]
        if site.ENABLE_USER_SITE:
            dirs.append(site.getusersitepackages())
        dirs = [d for d in dict.fromkeys(dirs) if d in sys.path and os.path.isdir(d)]
        dists: dict[str, str] = {}
        for dist in importlib.metadata.distributions(path=dirs):
            name = dist.metadata["Name"]
            if name and canonicalize_name(name) not in dists:  # the first on the path wins
                dists[canonicalize_name(name)] = dist.version
        system = any(d in sys.path for d in site.getsitepackages([sys.base_prefix]))
        return cls(executable=sys.executable, site_dirs=tuple(dirs), system_site=system,
                   distributions=dists)

    @property
    def fingerprint(self) -> str:
        """A hash of everything a job environment built over this one depends on."""
        text = json.dumps([self.executable, self.site_dirs, self.system_site,
                           sorted(self.distributions.items())])
        return hashlib.sha256(text.encode()).hexdigest()

    def constraints(self) -> dict[str, str]:
        """Each distribution pinned to its public version (`2.13.0` for `2.13.0+cpu`: an
        index has no local builds, and a pin without the local part matches the worker's)."""
        pins: dict[str, str] = {}
        for name, version in self.distributions.items():
            with contextlib.suppress(InvalidVersion):
                pins[name] = Version(version).public
        return pins


def cache_key(request: EnvRequest, base: BaseEnv) -> str:
    """The environment's name in the cache: a hash of what was asked and of the base."""
    text = json.dumps({"layout": ENV_LAYOUT, "pip": list(request.pip),
                       "requirements": request.requirements, "base": base.fingerprint})
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def to_install(resolved: str, pinned: Mapping[str, str]) -> list[str]:
    """The lines of a `uv pip compile --annotation-style line` resolution to install over the
    worker: its index options, and each package the worker lacks (not in `pinned`) that the
    request needs directly or through another such package (never only through one the
    worker has: the worker satisfies that package's dependencies already)."""
    options: list[str] = []
    lines: dict[str, str] = {}
    parents: dict[str, list[str]] = {}
    direct: set[str] = set()
    for raw in resolved.splitlines():
        text = raw.strip()
        if not text or text.startswith("#"):
            continue
        if text.startswith("-"):
            options.append(text)
            continue
        match = _VIA.match(text)
        req = match.group("req") if match else text
        try:
            name = str(canonicalize_name(Requirement(req).name))
        except InvalidRequirement:
            continue
        lines[name] = req
        parents[name] = []
        for via in (match.group("via").split(",") if match else []):
            via = via.strip()
            if via.startswith("-r"):
                direct.add(name)
            elif via and not via.startswith("-"):
                parents[name].append(str(canonicalize_name(via.split("[", 1)[0])))
    needed: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name in lines:
            if name in needed or name in pinned:
                continue
            if name in direct or any(p in needed for p in parents[name]):
                needed.add(name)
                changed = True
    return options + [lines[n] for n in sorted(needed)]


class UvBuild:
    """Builds one job environment with uv (an `EnvCache` build): a relocatable virtual
    environment over the worker's, what the request needs resolved against the worker's
    pins, what the worker lacks installed. uv's output goes to the attempt's log.

    Each uv run happens in `sandbox` when one is given (the tenant's uid, bubblewrap), else as
    the worker's user. The request is checked (`EnvRequest.refusal`) before uv runs, unless
    `check` is off: only the tests turn it off, to show what the sandbox alone holds back."""

    def __init__(self, request: EnvRequest, base: BaseEnv, *, uv: str, log_path: Path,
                 beat: Beat, beat_s: float, timeout_s: float,
                 sandbox: BuildSandbox | None = None, check: bool = True) -> None:
        self._request, self._base, self._uv = request, base, uv
        self._log_path, self._beat, self._beat_s = log_path, beat, beat_s
        self._timeout_s = timeout_s
        self._deadline = 0.0
        self._sandbox = sandbox
        self._check = check

    def __call__(self, scratch: Path) -> dict[str, Any]:
        request, base = self._request, self._base
        if self._check and (why := request.refusal()) is not None:
            raise SetupError(why)
        started = time.monotonic()
        self._deadline = started + self._timeout_s
        if self._sandbox is not None:
            self._sandbox.own(scratch)
        # Paths relative to `scratch`, uv's working directory: the log stays readable.
        self._run(["venv", "--relocatable", "--python", base.executable,
                   *(["--system-site-packages"] if base.system_site else []), "env"], scratch)
        site_packages = next((scratch / "env").glob("lib/python*/site-packages"))
        (site_packages / BASE_PTH).write_text(
            "import site; " + "; ".join(f"site.addsitedir({d!r})" for d in base.site_dirs) + "\n")
        pins = base.constraints()
        (scratch / "constraints.txt").write_text(
            "".join(f"{name}=={version}\n" for name, version in sorted(pins.items())))
        asked = list(request.pip)
        if request.requirements is not None:
            (scratch / "requirements.txt").write_text(request.requirements)
            asked.append("-r requirements.txt")
        (scratch / "request.in").write_text("".join(f"{line}\n" for line in asked))
        python = "env/bin/python"
        self._run(["pip", "compile", "--python", python, "--constraint", "constraints.txt",
                   "--annotation-style", "line", "--no-header", "--emit-index-url",
                   "--emit-find-links", "--output-file", "resolved.txt", "request.in"], scratch,
                  pins=pins)
        install = to_install(_read_text(scratch / "resolved.txt"), pins)
        packages = [line for line in install if not line.startswith("-")]
        if packages:
            (scratch / "install.txt").write_text("".join(f"{line}\n" for line in install))
            self._run(["pip", "install", "--python", python, "--no-deps", "-r", "install.txt"],
                      scratch)
        if self._sandbox is not None:
            self._sandbox.disown(scratch / "env")   # shared from the cache: root's now
        build_s = time.monotonic() - started
        log.info("env_built build_s=%.1f installed=%s", build_s, packages)
        return {"pip": list(request.pip), "requirements": request.requirements_name,
                "installed": packages, "base": base.fingerprint, "python": base.executable,
                "built_at": utcnow().isoformat(), "build_s": round(build_s, 3)}

    def _run(self, args: list[str], cwd: Path, *, pins: Mapping[str, str] | None = None) -> None:
        """Run uv in `cwd`, beating while it runs; its output joins the attempt's log. Wheels
        only; uv's own cache lives and goes with the build (the built environments are the
        cache), and it never downloads a Python of its own."""
        argv = [self._uv, *args]
        if args[0] == "pip":
            argv[3:3] = ["--no-build"]
        env = build_env(os.environ, scratch=cwd)
        enter = None
        if self._sandbox is not None:
            launch = self._sandbox.launch(argv, env, scratch=cwd, read_only=[
                Path(self._uv).parent, *operator_paths(env)])
            argv, env, enter = launch.argv, launch.env, launch.enter()
        out_path = cwd / "uv.out"
        with open(out_path, "wb") as out:
            proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=enter)
            try:
                while True:
                    try:
                        proc.wait(timeout=self._beat_s)
                        break
                    except subprocess.TimeoutExpired:
                        if time.monotonic() >= self._deadline:
                            raise SetupError(
                                f"building the job's environment took longer than "
                                f"{self._timeout_s:g} s (env_build_timeout_s)") from None
                        self._beat()
            finally:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        output = _tail(out_path)
        with open(self._log_path, "a") as attempt_log:
            attempt_log.write(f"e31: $ uv {' '.join(args)}\n{output}")
            if output and not output.endswith("\n"):
                attempt_log.write("\n")
        if proc.returncode != 0:
            step = " ".join(args[:2]) if args[0] == "pip" else args[0]
            if index_fault(output):
                raise SetupTransient(f"cannot install the job's requirements for now (uv "
                                     f"{step}): the package index failed: {_last_words(output)}")
            raise SetupError(f"cannot install the job's requirements (uv {step}): "
                             f"{_last_words(output)}{_pinned_hint(output, pins or {})}")


def build_env(environ: Mapping[str, str], *, scratch: Path) -> dict[str, str]:
    """A build's environment: of `environ` (the worker's) only what `BUILD_ENV_NAMES` and the
    operator's `UV_*` settings name, uv's cache in `scratch`, which is also HOME (so no file
    of the worker's home, a `.netrc` or a user-level `uv.toml`, is read), and no Python
    download."""
    env = {k: v for k, v in environ.items()
           if k in BUILD_ENV_NAMES or k.startswith(BUILD_ENV_PREFIX)}
    env.update(HOME=str(scratch), UV_CACHE_DIR=str(scratch / "uv-cache"),
               UV_PYTHON_DOWNLOADS="never", NO_COLOR="1")
    return env


def uv_binary() -> str:
    """The uv binary of the worker's environment (the `uv` package of the worker extra)."""
    try:
        import uv  # type: ignore[import-untyped,unused-ignore]
        return str(uv.find_uv_bin())
    except (ImportError, FileNotFoundError) as exc:
        raise RuntimeError("this worker cannot build job environments: uv is not installed "
                           "(install e31-batch[worker])") from exc


def _tail(path: Path) -> str:
    """The last `OUTPUT_MAX_BYTES` of uv's output."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        f.seek(max(0, size - OUTPUT_MAX_BYTES))
        data = f.read(OUTPUT_MAX_BYTES)
    return ((b"[...]\n" if size > OUTPUT_MAX_BYTES else b"") + data).decode(errors="replace")


def _read_text(path: Path) -> str:
    """A file uv wrote in the scratch directory (sandboxed: as the tenant's uid), read without
    following a link."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        return f.read(RESOLVED_MAX_BYTES).decode(errors="replace")


def _last_words(output: str) -> str:
    """What uv said last: its error and the cause, on one line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for i, line in enumerate(lines):
        if line.startswith(("error:", "×")):
            return " ".join(lines[i:])[:2000]
    return " ".join(lines[-3:])[:2000] or "no output"


def _pinned_hint(output: str, pins: Mapping[str, str]) -> str:
    """Why a resolution failed, when it names a package of the worker at its pin."""
    named = sorted(f"{n}=={v}" for n, v in pins.items() if f"{n}=={v}" in output)
    if not named:
        return ""
    return (f" ({', '.join(named[:5])}: the worker's own; a job adds packages, it does not "
            "change the worker's)")
