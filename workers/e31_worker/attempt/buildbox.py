"""The sandbox a job environment's build runs in (`UvBuild`, with `isolation = "sandbox"`).

uv reads what a job's requirements name; run as root outside any sandbox, it would read any
file of the host (the requirements check, `e31.core.requirements`, keeps such lines out; this is
the second wall, for whatever a line the check takes could still make uv read). So the build
runs as the job's does: as its tenant's unprivileged uid (`Sandbox.uid_for`), in bubblewrap's
user, mount, PID, IPC, UTS and cgroup namespaces, seeing the system and the worker's Python
read-only (`Sandbox.bind_args`, the very view a job gets: the protected paths hidden), the uv
binary and the operator's `UV_CONFIG_FILE` read-only, and its own scratch directory
read-write (the requirements copy, the constraints, `request.in`, uv's cache, the new
environment). `E31_HOME`, the store, the artifact store and other attempts do not exist for
it. What uv says, and so what it could quote of a file, is what the tenant could read anyway.

The scratch directory is handed to the tenant's uid before the build (`own`); the environment
built in it is handed back to root afterwards (`disown`: every file root's, no set-id bit),
before the cache publishes it, since every later job of every tenant asking the same uses it.

Network: the host's on a pool of `job_network = host`; else an isolated one, as a job's, from
which the operator's package indexes are reachable too (`e31_worker.attempt.network`).
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from urllib.parse import unquote, urlsplit

from e31_worker.attempt.binds import outermost, source
from e31_worker.attempt.network import UV_INDEX_VARS
from e31_worker.attempt.sandbox import RESOLV_CONF, Launch, Sandbox

# The operator's uv settings that may name a local index or wheel directory (a file:// URL or
# a path), bound read-only into a build's sandbox; an index named in a uv.toml instead lies in
# a directory the operator lists in `sandbox_read_only_dirs`.
UV_CONFIG_FILE = "UV_CONFIG_FILE"


class BuildSandbox:
    """One build's sandbox: the tenant's uid, over the worker's `Sandbox`."""

    def __init__(self, sandbox: Sandbox, *, uid: int) -> None:
        self._sandbox = sandbox
        self.uid = uid

    @classmethod
    def for_tenant(cls, sandbox: Sandbox, tenant_id: str) -> BuildSandbox:
        """The sandbox of a build on behalf of `tenant_id`: its jobs' uid."""
        return cls(sandbox, uid=sandbox.uid_for(tenant_id))

    def own(self, scratch: Path) -> None:
        """Hand the build's scratch directory (and what the worker wrote in it) to the uid."""
        _chown_tree(scratch, self.uid)

    def disown(self, tree: Path) -> None:
        """Hand what the build made back to root, without a set-id bit: no tenant may change
        an environment the cache shares, nor gain rights through one."""
        _chown_tree(tree, os.geteuid())

    def launch(self, argv: Sequence[str], env: Mapping[str, str], *, scratch: Path,
               read_only: Iterable[Path] = ()) -> Launch:
        """`argv` wrapped in bubblewrap, run in `scratch` (bound read-write) with `read_only`
        (the uv binary, the operator's uv configuration) bound read-only."""
        staged: list[Path] = []
        network = self._sandbox.network
        # the host's network, or the isolated one `enter` moves into; on a `none` pool
        # without slirp4netns none at all (a local index only)
        isolated = network.mode != "host" and network.unavailable(mode="isolated") is None
        share = network.mode == "host" or isolated
        args = [self._sandbox.bwrap, "--unshare-all", *(["--share-net"] if share else []),
                "--die-with-parent", "--new-session"]
        args += self._sandbox.bind_args(self.uid, staged=staged)
        if isolated and network.resolv_conf is not None and Path(RESOLV_CONF).exists():
            args += ["--ro-bind", source(network.resolv_conf, self.uid, staged), RESOLV_CONF]
        args += ["--bind", source(scratch, self.uid, staged), str(scratch)]
        for path in outermost(p for p in read_only if p.exists()):
            args += ["--ro-bind", source(path, self.uid, staged), str(path)]
        args += ["--chdir", str(scratch), "--", *argv]
        return Launch(argv=args, env={**env, "HOME": str(scratch)},
                      spec={"uid": self.uid, "staged": [str(p) for p in staged],
                            "net": network.plan(build=True) if isolated else None})


def operator_paths(env: Mapping[str, str]) -> list[Path]:
    """The local files a build's uv reads by the operator's settings in `env`: its
    `UV_CONFIG_FILE`, and the directories of the file:// indexes (an index's `simple` with
    the directory above it) and wheel directories its `UV_*` index settings name (each bound
    read-only into the build's sandbox)."""
    paths = [Path(env[UV_CONFIG_FILE])] if env.get(UV_CONFIG_FILE) else []
    for var in UV_INDEX_VARS:
        for token in re.split(r"[\s,]+", env.get(var, "")):
            location = token.split("=", 1)[1] if re.match(r"^[\w.-]+=", token) else token
            if location.startswith("file://"):
                path = Path(unquote(urlsplit(location).path))
            elif location.startswith("/"):
                path = Path(location)
            else:
                continue
            # An index's pages at <root>/simple link to its files beside them (<root>/files).
            paths.append(path.parent if path.name == "simple" else path)
    return [p for p in paths if p.is_absolute() and p.exists()]


def _chown_tree(root: Path, uid: int) -> None:
    """`root` and everything under it to `uid`:`uid` (links themselves, never followed), and
    no set-user-id or set-group-id bit left on anything."""
    paths = [str(root)]
    for top, dirs, files in os.walk(root):
        paths += [os.path.join(top, name) for name in (*dirs, *files)]
    for path in paths:
        os.chown(path, uid, uid, follow_symlinks=False)
        st = os.lstat(path)
        if not stat.S_ISLNK(st.st_mode) and st.st_mode & (stat.S_ISUID | stat.S_ISGID):
            os.chmod(path, stat.S_IMODE(st.st_mode) & ~(stat.S_ISUID | stat.S_ISGID))
