"""A tenant's batches of the OpenAI-compatible Batch API (`/v1/batches`; the routes are
`e31.api.routes.batches`): create, read, list, cancel. An adapter over native objects
(STYLE.md, rule 13):

- **create** reads the input file and checks every line (`e31.core.batchlines`); a bad file
  makes a batch that is `failed` at once, with OpenAI's `errors` naming the lines, and nothing
  runs. Otherwise each line's model is looked up (a line naming a model the pool does not
  know, or one of the wrong kind for the endpoint, fails alone: its error line is kept for the
  error file), the good lines are split into shards per model (`e31.core.batches.shard_sizes`:
  as many as the pool has GPUs for the model, within bounds), each shard's lines stored as a
  bundle, and the shards submitted as one array of `llm` jobs through the array service (the
  same limits, bundles, placement and insert as every array), due at the end of the window:
  the scheduler takes a tenant's earliest deadline first within its fair share.
- **cancel** cancels the array; the batch is `cancelling` until every shard ended, then
  `cancelled`, with what the shards committed in its output file (`batchends`).
"""

from __future__ import annotations

import io
import logging
import tarfile
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

from e31.api.services.arrays import ArrayService
from e31.api.services.batchends import SHARD_FILE, BatchEnds, rejected_line
from e31.api.services.files import FileService
from e31.core.batches import (
    ENDPOINT_KIND,
    BatchStatus,
    new_batch_id,
    shard_sizes,
    window_s,
)
from e31.core.batchlines import Checked, Request, check_lines
from e31.core.bundles import bundle_input
from e31.core.clock import utcnow
from e31.core.errors import SpecError, TooLarge
from e31.core.records import TenantRecord
from e31.core.sizeclasses import route
from e31.core.spec import MAX_TIMEOUT_S, JobSpec
from e31.edge.bundlestore import BundleStore
from e31.edge.settings import Settings
from e31.scheduling.placement import Shapes
from e31.store import Repo
from e31.store.batches import ModelRecord
from e31.store.models import Batch

log = logging.getLogger(__name__)

METADATA_KEYS_MAX = 16            # OpenAI's bounds on a batch's metadata
METADATA_KEY_MAX = 64
METADATA_VALUE_MAX = 512
GIB = 1024 ** 3
DEFAULT_SLOTS = 1                 # GPUs assumed for a model's class when no node is known


class BatchService:
    """Each tenant's batches."""

    def __init__(self, *, settings: Settings, repo: Repo, files: FileService,
                 bundles: BundleStore, arrays: ArrayService, ends: BatchEnds) -> None:
        self._settings = settings
        self._repo = repo
        self._files = files
        self._bundles = bundles
        self._arrays = arrays
        self._ends = ends

    def create(self, tenant: TenantRecord, *, input_file_id: str, endpoint: str,
               completion_window: str, metadata: Mapping[str, str] | None) -> Batch:
        """A new batch over the tenant's file `input_file_id` (see the module)."""
        self._check_window(completion_window)
        _check_metadata(metadata)
        source = self._files.get(tenant, input_file_id)
        if source.purpose != "batch":
            raise SpecError.one("input_file_id", f"file {input_file_id} has purpose "
                                                 f"{source.purpose!r}, not 'batch'")
        with self._files.open(tenant, input_file_id) as f:
            checked = check_lines(f, endpoint=endpoint,
                                  max_requests=self._settings.batch_max_requests)
        now = utcnow()
        row: dict[str, Any] = {
            "id": new_batch_id(), "tenant_id": tenant.id, "endpoint": endpoint,
            "input_file_id": input_file_id, "completion_window": completion_window,
            "meta": dict(metadata) if metadata else None, "created_at": now,
            "expires_at": now + timedelta(seconds=window_s(completion_window)), "shards": [],
            "request_completed": 0, "request_failed": 0, "rejected": 0,
            "prompt_tokens": 0, "completion_tokens": 0}
        errors = checked.errors_object()
        if errors is not None:
            batch = self._repo.insert_batch({**row, "status": BatchStatus.FAILED.value,
                                             "errors": errors, "failed_at": now,
                                             "request_total": 0})
            log.info("batch_failed_validation batch=%s tenant=%s lines=%d", batch.id,
                     tenant.name, checked.bad_lines)
            return batch
        models = self._repo.models(sorted({r.model for r in checked.requests}))
        kept, rejected = _known(checked, models, endpoint, row["id"])
        self._check_quota(tenant, kept)
        self._ends.store_rejected(tenant.id, row["id"], rejected)
        shards, items = self._shards(tenant, kept, models, row, endpoint)
        array_id = None
        if items:
            array_id = self._arrays.submit(tenant, items, name=row["id"],
                                           deadline_at=row["expires_at"]).id
        batch = self._repo.insert_batch({
            **row, "status": BatchStatus.IN_PROGRESS.value, "in_progress_at": now,
            "array_id": array_id, "shards": shards, "rejected": len(rejected),
            "request_total": len(checked.requests), "request_failed": len(rejected)})
        log.info("batch_created batch=%s tenant=%s requests=%d shards=%d rejected=%d",
                 batch.id, tenant.name, len(checked.requests), len(shards), len(rejected))
        return batch

    def _check_window(self, window: str) -> None:
        allowed = self._settings.batch_windows
        if window not in allowed:
            raise SpecError.one("completion_window", f"{window!r} is not a window this pool "
                                                     f"allows ({', '.join(allowed)})")

    def _check_quota(self, tenant: TenantRecord, kept: Mapping[str, list[Request]]) -> None:
        """`TooLarge` when the shards' bundles would take the tenant's bundles past its quota
        (`tenant_bundle_gb`): a batch's lines are stored as the tenant's bundles."""
        adding = sum(len(r.text) + 1 for requests in kept.values() for r in requests)
        quota = int(self._settings.tenant_bundle_gb * GIB)
        used = self._bundles.used_bytes(tenant.id)
        if adding and used + adding > quota:
            raise TooLarge(f"the batch's shards would take your tenant's bundles to "
                           f"{used + adding} bytes, over its quota of {quota} bytes "
                           f"(tenant_bundle_gb = {self._settings.tenant_bundle_gb:g})",
                           limit_bytes=quota)

    def _shards(self, tenant: TenantRecord, kept: Mapping[str, list[Request]],
                models: Mapping[str, ModelRecord], row: Mapping[str, Any], endpoint: str
                ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Each shard's note for the batch, and its job spec for the array."""
        nodes = self._arrays.nodes()    # the registered nodes, read once for every model
        timeout_s = min(float(window_s(row["completion_window"])), MAX_TIMEOUT_S)
        notes: list[dict[str, Any]] = []
        items: list[dict[str, Any]] = []
        for name, requests in kept.items():
            model = models[name]
            resources = _resources(model, nodes)
            sizes = shard_sizes(len(requests),
                                slots=max(DEFAULT_SLOTS, self._slots(resources, nodes)),
                                max_requests=self._settings.batch_shard_max_requests)
            start = 0
            for size in sizes:
                part = requests[start:start + size]
                start += size
                digest = self._store_shard(tenant.id, part)
                notes.append({"model": name, "count": size, "bundle": digest})
                items.append(_shard_spec(row["id"], len(items), model, endpoint, digest,
                                         resources, timeout_s))
        return notes, items

    def _slots(self, resources: Mapping[str, Any], nodes: Shapes | None) -> int:
        """GPUs the registered `nodes` have for a job of `resources` (the shards to aim at)."""
        spec = JobSpec.parse({"command": ["true"], "resources": dict(resources)})
        where = route(spec, self._settings.size_classes)
        return sum((nodes or {}).get(where.size_class, {}).values())

    def _store_shard(self, tenant_id: str, requests: Sequence[Request]) -> str:
        """A bundle of one entry, the shard's lines; returns its digest."""
        data = "".join(r.text + "\n" for r in requests).encode()
        info = tarfile.TarInfo(SHARD_FILE)
        info.size = len(data)
        info.mode = 0o644
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
            tar.addfile(info, io.BytesIO(data))
        with self._bundles.upload(tenant_id) as upload:
            upload.write(buf.getvalue())
            if self._bundles.exists(tenant_id, upload.digest):
                return upload.digest
            return self._bundles.commit(upload, tenant_id)

    def get(self, tenant: TenantRecord, batch_id: str) -> Batch:
        """The batch, moved on first if its shards moved (`BatchEnds.settle`)."""
        return self._ends.settle(self._repo.get_batch(tenant.id, batch_id))

    def list(self, tenant: TenantRecord, *, limit: int, after: str | None) -> list[Batch]:
        return [self._ends.settle(b)
                for b in self._repo.list_batches(tenant.id, limit=limit, after=after)]

    def cancel(self, tenant: TenantRecord, batch_id: str) -> Batch:
        """Cancel the batch's shards; it is `cancelling` until they all ended."""
        batch = self._repo.get_batch(tenant.id, batch_id)
        live = (BatchStatus.VALIDATING.value, BatchStatus.IN_PROGRESS.value)
        if self._repo.move_batch(batch.id, live, status=BatchStatus.CANCELLING.value,
                                 cancelling_at=utcnow()) and batch.array_id:
            self._arrays.cancel(tenant, batch.array_id)
            log.info("batch_cancel_requested batch=%s tenant=%s", batch.id, tenant.name)
        return self.get(tenant, batch_id)


def _known(checked: Checked, models: Mapping[str, ModelRecord], endpoint: str,
           batch_id: str) -> tuple[dict[str, list[Request]], list[bytes]]:
    """The good lines by model (in the order the models first appear), and the error lines
    of those naming a model the pool lacks (`models` has the ones it has) or one of another
    kind."""
    kind = ENDPOINT_KIND[endpoint]
    kept: dict[str, list[Request]] = {}
    rejected: list[bytes] = []
    for r in checked.requests:
        m = models.get(r.model)
        if m is None:
            rejected.append(rejected_line(batch_id, r.custom_id, "model_not_found",
                                          f"the model {r.model!r} does not exist on this "
                                          "pool (e31 model list names those it has)"))
        elif m.kind != kind:
            rejected.append(rejected_line(batch_id, r.custom_id, "model_not_supported",
                                          f"the model {r.model!r} is a {m.kind} model; "
                                          f"{endpoint} needs a {kind} model"))
        else:
            kept.setdefault(r.model, []).append(r)
    return kept, rejected


def _resources(model: ModelRecord, nodes: Shapes | None) -> dict[str, Any]:
    """A shard's resources: one GPU of the class its model needs; a model that states no
    GPU memory (the built-in tiny ones) runs in the cpu class on a pool whose `nodes` have no
    GPU at all, so a laptop's first batch runs."""
    if model.gpu_mem_gb:
        return {"gpus": 1, "gpu_mem_gb": model.gpu_mem_gb}
    if nodes is not None and not any(sum(h.values()) for h in nodes.values()):
        return {"gpus": 0}
    return {"gpus": 1}


def _shard_spec(batch_id: str, index: int, model: ModelRecord, endpoint: str, digest: str,
                resources: Mapping[str, Any], timeout_s: float) -> dict[str, Any]:
    """One shard's job: the `llm` workload over its lines and its model."""
    return {"name": f"{batch_id}/{index}", "workload": "llm",
            "params": {"requests": "requests", "model": "model", "model_name": model.name,
                       "endpoint": endpoint, "batch_id": batch_id},
            "inputs": {"requests": bundle_input(digest, SHARD_FILE), "model": model.path},
            "resources": dict(resources), "timeout_s": timeout_s, "preemptible": True}


def _check_metadata(metadata: Mapping[str, str] | None) -> None:
    if not metadata:
        return
    if len(metadata) > METADATA_KEYS_MAX:
        raise SpecError.one("metadata", f"at most {METADATA_KEYS_MAX} keys")
    for k, v in metadata.items():
        if len(k) > METADATA_KEY_MAX or len(v) > METADATA_VALUE_MAX:
            raise SpecError.one(f"metadata.{k[:METADATA_KEY_MAX]}",
                                f"keys hold {METADATA_KEY_MAX} characters at most and values "
                                f"{METADATA_VALUE_MAX}")
