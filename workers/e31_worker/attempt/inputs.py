"""The prepare stage's data: stage each of a job's inputs into `$E31_INPUT_DIR/<name>`.

An input is an uploaded bundle entry (`bundle:sha256:<hex>/<entry>`, fetched through the host's
bundle cache, like the code) or a URL the worker reads with fsspec (`s3://`, `http(s)://`, and
`file://` beneath a directory of `input_file_roots` only: the worker reads it with its own
rights). `http(s)://` is read with httpx (one file); `s3://` with fsspec, which needs `s3fs`
installed on the workers. A local `file://` tree is copied without following a link, so a
link planted in a shared directory does not hand a job what it points at. An input that
cannot be staged fails the attempt with reason `setup`, naming it (docs/jobs.md, "Bring your
code, environment and data").
"""

from __future__ import annotations

import logging
import os
import posixpath
import stat
from pathlib import Path
from typing import IO

import fsspec
import httpx

from e31.artifacts import scan_tree
from e31.blobs import BundleStore
from e31.bundles import beneath, file_input_path, input_scheme, parse_bundle_input
from e31.errors import SetupError
from e31.store.records import Claim
from e31_worker.attempt.bundle import cache_for, remove_tree, unpack
from e31_worker.attempt.services import AttemptServices
from e31_worker.attempt.supervisor import AttemptPlan

log = logging.getLogger(__name__)

COPY_CHUNK_BYTES = 1024 * 1024
HTTP_TIMEOUT_S = 60.0     # between two reads of an http(s) input, not for the whole of it
STAGING_PREFIX = ".staging-"


def stage_inputs(svc: AttemptServices, claim: Claim, plan: AttemptPlan) -> None:
    """Make `plan.input_dir` and stage every input of the claimed job into it."""
    plan.input_dir.mkdir(parents=True, exist_ok=True)
    for name, source in sorted(claim.spec.inputs.items()):
        target = plan.input_dir / name
        try:
            kind = _stage(svc, claim, source, target)
        except SetupError as exc:
            raise SetupError(f"inputs.{name}: {exc.message}") from exc
        except (OSError, ValueError, httpx.HTTPError) as exc:   # the store's or the server's
            raise SetupError(f"inputs.{name}: cannot read {source}: {exc}") from exc
        except ImportError as exc:   # fsspec's backend for the scheme is not installed
            raise SetupError(f"inputs.{name}: this worker cannot read {source}: {exc}") from exc
        log.info("input_staged job=%s attempt=%d input=%s from=%s", claim.job_id,
                 claim.attempt, name, kind)


def _stage(svc: AttemptServices, claim: Claim, source: str, target: Path) -> str:
    scheme = input_scheme(source)
    if scheme is None:
        _stage_bundle(svc, claim, source, target)
        return "bundle"
    if scheme == "file":
        _copy_local(file_input_path(source, svc.settings.input_file_roots), target,
                    svc.settings.input_file_roots)
        return "file"
    if scheme in ("http", "https"):
        _download(source, target)
    else:
        _copy_remote(source, target)
    return scheme


def _download(url: str, target: Path) -> None:
    """GET one file (redirects followed), streamed to `target`."""
    with httpx.stream("GET", url, follow_redirects=True, timeout=HTTP_TIMEOUT_S) as response:
        response.raise_for_status()
        with open(target, "xb") as out:
            for chunk in response.iter_bytes(COPY_CHUNK_BYTES):
                out.write(chunk)


def _stage_bundle(svc: AttemptServices, claim: Claim, source: str, target: Path) -> None:
    """Unpack the uploaded input's bundle beside `target`, then move its entry into place."""
    digest, entry = parse_bundle_input(source)
    f, _ = cache_for(svc.settings).open(BundleStore(svc.artifacts.url), claim.tenant_id, digest)
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


def _copy_local(path: str, target: Path, roots: tuple[str, ...]) -> None:
    """Copy a worker-local file or tree, resolved beneath `roots`, never through a link."""
    real = os.path.realpath(path)
    if not any(beneath(real, os.path.realpath(root)) for root in roots):
        raise SetupError(f"{path} resolves to {real}, outside input_file_roots")
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


def _copy_remote(url: str, target: Path) -> None:
    """Copy a remote file, or every file under a remote directory (`s3://`), with fsspec."""
    fs, path = fsspec.core.url_to_fs(url)
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
