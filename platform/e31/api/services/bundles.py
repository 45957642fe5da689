"""A tenant's code and data bundles, uploaded once under their sha256, and what a submission
checks of the bundles and inputs its spec names (docs/jobs.md, "Bring your code, environment
and data"); the routes are `e31.api.routes.bundles`.

`BundleService.receive` streams a body into the store while hashing it: over `bundle_max_bytes`
it refuses 413 naming the limit, and past the tenant's quota of all its bundles together
(`tenant_bundle_gb`; 0: no bundles) 413 naming the quota and the bytes in use, checked before
the body is read, while it is, and once more, counting the tenant's other uploads in progress,
just before it is committed (`BundleStore.used_bytes`); a body whose sha256 is not the one named
(409: the body conflicts with its name), or a tar with a path that escapes, a link out, a hard
link, a device, a sparse file or a header that cannot be read (422 naming the member), is
removed and nothing is stored. `BundleService.check_spec` is the bundles step of a submission
(`e31.api.services.submission`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio.to_thread

from e31.core.addresses import url_refusal
from e31.core.bundles import (
    ARRAY_INPUT,
    check_digest,
    file_input_path,
    input_scheme,
    parse_bundle_input,
    tar_problems,
)
from e31.core.errors import NotFound, SpecConflict, SpecError, SpecForbidden, TooLarge
from e31.core.records import TenantRecord
from e31.core.spec import JobSpec
from e31.edge.bundlestore import BundleStore, Upload
from e31.edge.s3inputs import artifact_store_input
from e31.edge.settings import Settings

log = logging.getLogger(__name__)

PROBLEMS_SHOWN = 20      # bad members named in one answer
GIB = 1024 ** 3


class BundleService:
    """The bundles of each tenant, as the API receives them and as specs name them."""

    def __init__(self, *, settings: Settings, store: BundleStore) -> None:
        self._settings = settings
        self._store = store

    @property
    def max_bytes(self) -> int:
        return self._settings.bundle_max_bytes

    @property
    def quota_bytes(self) -> int:
        """The most bytes one tenant's bundles may take together (`tenant_bundle_gb`)."""
        return int(self._settings.tenant_bundle_gb * GIB)

    def size(self, tenant: TenantRecord, digest: str) -> int:
        """The size of the tenant's bundle `digest`; `NotFound` when it holds none of that
        hash (another tenant's answers the same)."""
        size = self._store.size(tenant.id, _digest(digest))
        if size is None:
            raise NotFound(f"no bundle {_digest(digest)} of your tenant")
        return size

    async def receive(self, tenant: TenantRecord, digest: str, chunks: AsyncIterator[bytes],
                      declared_bytes: int | None) -> dict[str, Any]:
        """Store the body `chunks` as the tenant's bundle `digest`, checked as the module says;
        a bundle the tenant holds already is not read again."""
        digest = _digest(digest)
        size = await anyio.to_thread.run_sync(self._store.size, tenant.id, digest)
        if size is not None:
            return {"bundle": digest, "bytes": size, "stored": False}
        if declared_bytes is not None and declared_bytes > self.max_bytes:
            raise TooLarge(self._too_large(), limit_bytes=self.max_bytes)
        used = await anyio.to_thread.run_sync(self._store.used_bytes, tenant.id)
        self._check_quota(used, declared_bytes or 0)
        with self._store.upload(tenant.id) as upload:
            async for chunk in chunks:
                if upload.size_bytes + len(chunk) > self.max_bytes:
                    raise TooLarge(self._too_large(), limit_bytes=self.max_bytes)
                self._check_quota(used, upload.size_bytes + len(chunk))
                await anyio.to_thread.run_sync(upload.write, chunk)
            if upload.digest != digest:
                raise SpecConflict.one("bundle", f"the body's sha256 is {upload.digest}, not "
                                                 f"the {digest} it was sent as; nothing was "
                                                 "stored")
            problems = await anyio.to_thread.run_sync(self._problems, upload)
            if problems:
                raise SpecError([{"field": "bundle", "reason": p} for p in problems])
            # Once more, with the whole upload written: every other upload of the tenant now
            # counts, as this one counts in theirs (e31.edge.bundlestore says why two cannot
            # both pass).
            used = await anyio.to_thread.run_sync(self._store.used_bytes, tenant.id)
            self._check_quota(used - upload.size_bytes, upload.size_bytes)
            await anyio.to_thread.run_sync(self._store.commit, upload, tenant.id)
        log.info("bundle_stored tenant=%s bundle=%s bytes=%d", tenant.name, digest,
                 upload.size_bytes)
        return {"bundle": digest, "bytes": upload.size_bytes, "stored": True}

    def _problems(self, upload: Upload) -> list[str]:
        with self._store.open_upload(upload) as f:
            return tar_problems(f, limit=PROBLEMS_SHOWN)

    def _check_quota(self, used_bytes: int, adding_bytes: int) -> None:
        """`TooLarge` naming the tenant's bundle quota when `adding_bytes` to the `used_bytes`
        its bundles (and other uploads) take would pass it."""
        quota = self.quota_bytes
        if quota == 0:
            raise TooLarge("bundles are off on this pool (tenant_bundle_gb = 0): pass code and "
                           "data as s3:// or http(s):// inputs", limit_bytes=0)
        if used_bytes + adding_bytes > quota:
            raise TooLarge(f"your tenant's bundles would take {used_bytes + adding_bytes} bytes, "
                           f"over its quota of {quota} bytes (tenant_bundle_gb = "
                           f"{self._settings.tenant_bundle_gb:g}); {used_bytes} bytes are in "
                           "use already", limit_bytes=quota)

    def _too_large(self) -> str:
        return (f"the bundle is larger than {self.max_bytes} bytes (bundle_max_bytes); leave "
                "big files out (.e31ignore) and pass big data as an s3:// or http(s):// input")

    def check_spec(self, tenant_id: str, spec: JobSpec, *, dry_run: bool = False) -> list[str]:
        """Check the bundles and inputs `spec` names for the tenant: a `file://` input outside
        `input_file_roots`, an `s3://` one in the artifact store (e31.edge.s3inputs) or an
        `http(s)://` one whose URL shows an address no input may reach (`localhost`,
        `127.0.0.1`: e31.core.addresses) is forbidden (`SpecForbidden` naming `inputs.<name>`),
        and a bundle the tenant never uploaded
        conflicts with what the store holds (`SpecConflict` naming
        `code` or `inputs.<name>`), unless `dry_run`, which returns the fields that name one
        instead."""
        self._check_addresses(spec)
        errors: list[dict[str, str]] = []
        missing: list[str] = []
        if spec.code is not None and not self._store.exists(tenant_id, spec.code):
            missing.append("code")
        for name, source in spec.inputs.items():
            field = f"inputs.{name}"
            scheme = input_scheme(source)
            if ARRAY_INPUT.fullmatch(source):
                continue   # the store checks the array is the tenant's (JobService.submit)
            if scheme is None:
                digest, _ = parse_bundle_input(source)
                if not self._store.exists(tenant_id, digest):
                    missing.append(field)
            elif scheme == "file":
                try:
                    file_input_path(source, self._settings.file_roots)
                except ValueError as exc:
                    errors.append({"field": field, "reason": str(exc)})
            elif scheme == "s3":   # never the artifact store's objects (e31.edge.s3inputs)
                refused = artifact_store_input(source, self._settings.resolved_artifacts_url)
                if refused is not None:
                    errors.append({"field": field, "reason": refused})
        if errors:
            raise SpecForbidden(errors)
        if missing and not dry_run:
            raise SpecConflict([{"field": f, "reason": "names a bundle this tenant has not "
                                                       "uploaded (PUT /v1/bundles/sha256:…; "
                                                       "Client.submit and e31 submit upload "
                                                       "it)"} for f in missing])
        return missing

    def _check_addresses(self, spec: JobSpec) -> None:
        """`SpecForbidden` (403, as a `file://` input outside the roots) naming each
        `http(s)://` input whose URL shows an address no input may reach (e31.core.addresses); the
        worker checks every address it connects to as well."""
        allowed = self._settings.input_allowed_networks
        refused = [{"field": f"inputs.{name}", "reason": f"refused: {why}"}
                   for name, source in spec.inputs.items()
                   if input_scheme(source) in ("http", "https")
                   and (why := url_refusal(source, allowed)) is not None]
        if refused:
            raise SpecForbidden(refused)


def _digest(value: str) -> str:
    try:
        return check_digest(value)
    except ValueError as exc:
        raise SpecError.one("bundle", str(exc)) from None
