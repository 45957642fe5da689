"""What a sandbox binds, and from where (`e31_worker.attempt.sandbox`).

The system and the worker's Python are bound read-only; the paths no job may see
(`protected_paths`) are never bound, nor any directory that holds one; a system directory
that holds one gets it hidden. bubblewrap resolves a bind's source as the job's unprivileged
user, so a source that user cannot reach (under a 0700 `E31_HOME`, a Python under `/root`)
is staged first: the forked child, still root, makes a private mount namespace, mounts a
tmpfs on `STAGE_DIR` and binds each such source there (`enter_as`), then drops to the job's
uid. Nothing of that is seen outside the child.
"""

from __future__ import annotations

import importlib.util
import os
import site
import stat
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from urllib.parse import urlsplit

from e31.edge.settings import Settings
from e31_worker.child.spawner import STAGE_DIR

SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")


def protected_paths(settings: Settings) -> list[Path]:
    """What no job may see: E31_HOME, the work dir (every attempt), the SQLite store, the
    artifact store on this host, the Redis password file."""
    paths = [settings.home, settings.resolved_work_dir]
    db = urlsplit(settings.resolved_database_url)
    if db.scheme.startswith("sqlite") and db.path not in ("", "/", "/:memory:"):
        paths.append(Path(db.path[1:] if db.path.startswith("//") else db.path))
    artifacts = urlsplit(settings.resolved_artifacts_url)
    if artifacts.scheme == "file":
        paths.append(Path(artifacts.path))
    if settings.redis_password_file:
        paths.append(Path(settings.redis_password_file))
    if settings.s3_secret_access_key_file:
        paths.append(Path(settings.s3_secret_access_key_file))
    return [Path(os.path.realpath(p)) for p in paths]


def python_paths() -> list[Path]:
    """What a job needs of the worker's Python: its prefixes, site directories, the worker's
    own packages (an editable install points outside site-packages) and PYTHONPATH."""
    found = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             *site.getsitepackages(), *sys.path[1:]]   # sys.path[0]: the worker's own cwd
    for package in ("e31", "e31_worker"):
        spec = importlib.util.find_spec(package)
        found += [str(Path(p).parent) for p in (spec.submodule_search_locations or [])] \
            if spec else []
    found += os.environ.get("PYTHONPATH", "").split(os.pathsep)
    out: list[Path] = []
    for entry in found:
        if entry and os.path.isabs(entry) and os.path.exists(entry):
            real = Path(os.path.realpath(entry))
            if real not in out:
                out.append(real)
    return out


def exposes(path: Path, protected: Sequence[Path]) -> str | None:
    """Why binding `path` would show a protected path, or None."""
    real = Path(os.path.realpath(path))
    for hidden in protected:
        if real.is_relative_to(hidden):
            return f"is inside {hidden}"
        if hidden.is_relative_to(real) and not any(real.is_relative_to(s)
                                                   for s in map(Path, SYSTEM_PATHS)):
            return f"holds {hidden}"
    return None


def outermost(paths: Iterable[Path]) -> list[Path]:
    """`paths` without those inside another one of them or inside a system directory."""
    system = [Path(p) for p in SYSTEM_PATHS]
    unique = sorted(set(paths), key=lambda p: len(p.parts))
    kept: list[Path] = []
    for p in unique:
        if not any(p.is_relative_to(k) for k in (*kept, *system)):
            kept.append(p)
    return kept


def _reachable(path: Path, uid: int) -> bool:
    """Whether `uid` (whose gid is its uid, with no other group) may look `path` up."""
    for parent in reversed(path.parents):
        st = os.stat(parent)
        bit = (stat.S_IXUSR if st.st_uid == uid else
               stat.S_IXGRP if st.st_gid == uid else stat.S_IXOTH)
        if not st.st_mode & bit:
            return False
    return True


def source(path: Path, uid: int, staged: list[Path] | None) -> str:
    """The source bubblewrap binds `path` from: itself where the job's uid can reach it, else
    its place under STAGE_DIR, where the child binds it before dropping its rights. With no
    `staged` list (a warm start, whose child binds as root): always itself."""
    real = Path(os.path.realpath(path))
    if staged is None or _reachable(real, uid):
        return str(real)
    staged.append(real)
    return str(STAGE_DIR / str(len(staged) - 1))
