"""The inputs stage: stage each of a job's inputs into `$E31_INPUT_DIR/<name>`.

An input is an uploaded bundle entry (`bundle:sha256:<hex>/<entry>`, fetched through the host's
bundle cache, like the code) or a URL the worker reads with fsspec (`s3://`, `http(s)://`, and
`file://` beneath a directory of `input_file_roots` only: the worker reads it with its own
rights). `http(s)://` is read with httpx (one file), from a public address or one of
`input_allowed_networks` only, checked at every connection (`e31_worker.attempt.http_inputs`);
`s3://` with fsspec, which needs `s3fs` installed on the workers: anonymously or with the
inputs' own credentials, never the artifact store's, and never from the store's bucket/prefix
(`e31.edge.s3inputs`). A local `file://` tree is copied without following a link, so a link planted
in a shared directory does not hand a job what it points at. An input that cannot be staged
fails the attempt with reason `setup`, naming it (docs/jobs.md, "Bring your code, environment
and data"); one whose server or store failed in a way that may pass (a 503, a reset
connection: `e31_worker.attempt.transient`) ends it with reason `setup_transient`, the pool's,
and the job runs again without spending its retries.

A local `file://` *file* that every user may read is not copied when the job runs in a
sandbox: `$E31_INPUT_DIR/<name>` becomes a link to its resolved path, and that one file is
bound read-only into the sandbox at that path (`stage_inputs` returns it; the supervisor adds
it to the sandbox's read-only binds). A footage chunk then reads only the byte range of its
span, not a copy of the whole video per chunk (docs/workloads.md, "Forty hours of footage").
The job reads it with its own uid's rights (hence "every user may read"), cannot write it (a
read-only mount) and sees nothing beside it. A file only its owner may read, a tree, and any
input of a job without a sandbox (`--isolation process`: the job has the worker's rights, and
a link would hand it the source to write) are copied, as before.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import posixpath
import stat
from pathlib import Path
from typing import IO, Any

import fsspec
import httpx

from e31.core.bundles import (
    ARRAY_INPUT,
    beneath,
    file_input_path,
    input_scheme,
    parse_array_input,
    parse_bundle_input,
)
from e31.core.errors import NotFound, SetupError, SetupTransient
from e31.core.records import Claim
from e31.edge.bundlestore import BundleStore
from e31.edge.localwalk import scan_tree
from e31.edge.s3inputs import artifact_store_input, input_storage_options, same_credentials
from e31.edge.settings import Settings
from e31_worker.attempt.binds import exposes, protected_paths
from e31_worker.attempt.code import cache_for, remove_tree, unpack
from e31_worker.attempt.http_inputs import download
from e31_worker.attempt.plan import AttemptPlan
from e31_worker.attempt.services import AttemptServices
from e31_worker.attempt.stages import Attempt, Stage
from e31_worker.attempt.transient import is_transient

log = logging.getLogger(__name__)

COPY_CHUNK_BYTES = 1024 * 1024
STAGING_PREFIX = ".staging-"


class InputsStage(Stage):
    """The inputs stage: every input of the job staged into the attempt's `inputs` directory;
    the local files staged as links are added to the plan, for the sandbox to bind."""

    def setup(self, attempt: Attempt) -> None:
        binds = stage_inputs(attempt.svc, attempt.claim, attempt.plan)
        attempt.plan = dataclasses.replace(attempt.plan, input_binds=binds)


def stage_inputs(svc: AttemptServices, claim: Claim, plan: AttemptPlan) -> tuple[Path, ...]:
    """Make `plan.input_dir` and stage every input of the claimed job into it; returns the
    files the sandbox must bind read-only (the targets of the links staged for them)."""
    plan.input_dir.mkdir(parents=True, exist_ok=True)
    binds: list[Path] = []
    for name, source in sorted(claim.spec.inputs.items()):
        target = plan.input_dir / name
        try:
            kind = _stage(svc, claim, source, target, binds)
        except SetupError as exc:   # a SetupTransient stays one
            raise type(exc)(f"inputs.{name}: {exc.message}") from exc
        except ImportError as exc:   # fsspec's backend for the scheme is not installed
            raise SetupError(f"inputs.{name}: this worker cannot read {source}: {exc}") from exc
        except Exception as exc:   # the store's, the server's or any fsspec backend's
            if is_transient(exc):
                raise SetupTransient(f"inputs.{name}: cannot read {source} for now: "
                                     f"{_described(exc)}") from exc
            if not isinstance(exc, OSError | ValueError | httpx.HTTPError):
                raise   # the worker's own error
            raise SetupError(f"inputs.{name}: cannot read {source}: {exc}") from exc
        log.info("input_staged job=%s attempt=%d input=%s from=%s copied_bytes=%d",
                 claim.job_id, claim.attempt, name, kind, copied_bytes(target))
    return tuple(binds)


def _described(exc: BaseException) -> str:
    """An error's text, with its type where the text alone says little ("" or a bare errno)."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def copied_bytes(target: Path) -> int:
    """The bytes a staged input holds in the attempt's directory (0 for a bound file's link)."""
    if target.is_symlink() or not target.exists():
        return 0
    if not target.is_dir():
        return target.stat().st_size
    return sum(f.lstat().st_size for f in target.rglob("*") if f.is_file() and not f.is_symlink())


def _stage(svc: AttemptServices, claim: Claim, source: str, target: Path,
           binds: list[Path]) -> str:
    scheme = input_scheme(source)
    if ARRAY_INPUT.fullmatch(source):
        _stage_array(svc, claim, parse_array_input(source), target)
        return "array"
    if scheme is None:
        _stage_bundle(svc, claim, source, target)
        return "bundle"
    if scheme == "file":
        path = file_input_path(source, svc.settings.file_roots)
        roots = svc.settings.file_roots
        if svc.sandbox is not None:
            bound = link_local_file(path, target, roots, protected_paths(svc.settings))
            if bound is not None:
                binds.append(bound)
                return "file-bound"
        _copy_local(path, target, roots)
        return "file"
    if scheme in ("http", "https"):
        download(source, target, svc.settings.input_allowed_networks)
    elif scheme == "s3":
        _copy_s3(svc.settings, source, target)
    else:
        _copy_remote(source, target, {})
    return scheme


def _copy_s3(settings: Settings, source: str, target: Path) -> None:
    """An `s3://` input: never the artifact store's objects (as at submit, checked again for
    a spec that reached the queue otherwise), never read with its credentials
    (e31.edge.s3inputs)."""
    refused = artifact_store_input(source, settings.resolved_artifacts_url)
    if refused is None:
        refused = same_credentials(settings)
    if refused is not None:
        raise SetupError(f"refused {source}: {refused}")
    _copy_remote(source, target, input_storage_options(settings))


def _stage_bundle(svc: AttemptServices, claim: Claim, source: str, target: Path) -> None:
    """Unpack the uploaded input's bundle beside `target`, then move its entry into place."""
    digest, entry = parse_bundle_input(source)
    store = BundleStore(svc.artifacts.url, svc.artifacts.storage_options)
    f, _ = cache_for(svc.settings).open(store, claim.tenant_id, digest)
    staging = target.with_name(f"{STAGING_PREFIX}{target.name}")
    try:
        with f:
            unpack(f, staging, read_only=False)
        unpacked = staging / entry
        if not unpacked.exists() or unpacked.is_symlink():
            raise SetupError(f"bundle {digest} holds no {entry!r}")
        unpacked.rename(target)
    finally:
        remove_tree(staging)


def _stage_array(svc: AttemptServices, claim: Claim, array_id: str, target: Path) -> None:
    """Every output of the array's items, as `<item index, 6 digits>/<path>`. The array is
    looked up as the job's tenant's (NotFound for another's, as at submit): the worker reads
    the store for the job, which holds no credential of its own."""
    try:
        manifest = svc.repo.array_manifest(claim.tenant_id, array_id)
    except NotFound as exc:
        raise SetupError(f"no array {array_id} of this tenant") from exc
    target.mkdir()
    for item in manifest.items:
        svc.artifacts.get_tree(claim.tenant_id, item.id, "outputs", target / f"{item.index:06d}")


def link_local_file(path: str, target: Path, roots: tuple[str, ...],
                    protected: list[Path]) -> Path | None:
    """Stage a worker-local regular file that every user may read as a link at `target` to
    its resolved path, which the sandbox binds read-only; returns that path. None (copy it
    instead): a tree, a file its owner alone may read, or one inside a path no job may see."""
    real = _resolved(path, roots)
    st = os.stat(real)
    if not stat.S_ISREG(st.st_mode) or not st.st_mode & stat.S_IROTH:
        return None
    if exposes(Path(real), protected) is not None:
        return None
    target.symlink_to(real)
    return Path(real)


def _resolved(path: str, roots: tuple[str, ...]) -> str:
    real = os.path.realpath(path)
    if not any(beneath(real, os.path.realpath(root)) for root in roots):
        raise SetupError(f"{path} resolves to {real}, outside input_file_roots")
    return real


def _copy_local(path: str, target: Path, roots: tuple[str, ...]) -> None:
    """Copy a worker-local file or tree, resolved beneath `roots`, never through a link."""
    real = _resolved(path, roots)
    st = os.stat(real)
    if stat.S_ISREG(st.st_mode):
        _copy_file(Path(real), target)
        return
    if not stat.S_ISDIR(st.st_mode):
        raise SetupError(f"{path} is neither a file nor a directory")
    scan = scan_tree(Path(real))
    for refused in scan.refused:
        log.warning("input_refused path=%s/%s reason=%s", real, refused.path, refused.reason)
    target.mkdir()
    for rel in scan.files:
        dest = target / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        _copy_file(Path(real) / rel, dest)


def _copy_file(src: Path, dest: Path) -> None:
    fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise SetupError(f"{src} is not a regular file")
        _write(f, dest)


def _copy_remote(url: str, target: Path, options: dict[str, Any]) -> None:
    """Copy a remote file, or every file under a remote directory (`s3://`), with fsspec
    and its `options` (the endpoint and credentials)."""
    fs, path = fsspec.core.url_to_fs(url, **options)
    if fs.isdir(path):
        base = path.rstrip("/")
        target.mkdir()
        for found in sorted(fs.find(base)):
            rel = posixpath.relpath(found, base)
            if rel.startswith("../") or rel in (".", ".."):
                continue
            dest = target / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            with fs.open(found, "rb") as f:
                _write(f, dest)
        return
    with fs.open(path, "rb") as f:
        _write(f, target)


def _write(src: IO[bytes], dest: Path) -> None:
    with open(dest, "xb") as out:
        while chunk := src.read(COPY_CHUNK_BYTES):
            out.write(chunk)
