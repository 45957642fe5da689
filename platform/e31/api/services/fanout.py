"""A footage `source` submitted as one job (docs/workloads.md): its chunk jobs as one array and
a merge job after it, planned here (the files listed, the videos' durations probed:
`e31.ops.fanout.plan`) and stored in one transaction; the merge job's record is the answer.

Each chunk takes the steps of a submission (`e31.api.services.submission`) in their order:
limits → bundles → secrets → (the request's tally) → placement; the merge job its limits and
placement; then the insert. A dry run plans the same and stores nothing.
"""

from __future__ import annotations

import logging
from typing import Any

from e31.api.services.arrays import array_name
from e31.api.services.requirements import Memo
from e31.api.services.submission import Submission
from e31.core.clock import utcnow
from e31.core.errors import SpecError
from e31.core.footage import CHUNKS_INPUT
from e31.core.names import NAME_MAX
from e31.core.records import JobRecord, TenantRecord
from e31.core.sizeclasses import Route
from e31.core.spec import JobSpec
from e31.core.tenantlimits import TenantLimits
from e31.edge.settings import Settings
from e31.ops.fanout import MERGE_ENTRYPOINT
from e31.ops.fanout import plan as plan_fanout
from e31.ops.sweep import MAX_ARRAY_ITEMS
from e31.store import Repo

log = logging.getLogger(__name__)


class FanoutService:
    """The fan-out of a footage source, over one store and the steps of a submission."""

    def __init__(self, *, settings: Settings, repo: Repo, steps: Submission) -> None:
        self._settings = settings
        self._repo = repo
        self._steps = steps

    def submit(self, tenant: TenantRecord, spec: JobSpec, limits: TenantLimits) -> JobRecord:
        """Store the chunk jobs as one array and the merge job after it (`limits`: the
        tenant's, already checked against its rate and body size); the merge job's record."""
        items, merge = self._specs(tenant, spec, limits)
        name = array_name(spec.name or "footage")

        def merge_spec(array_id: str) -> tuple[JobSpec, Route]:
            data = {**merge, "after": [array_id],
                    "inputs": {CHUNKS_INPUT: f"array:{array_id}/outputs"}}
            return self._steps.place(self._steps.within_limits(JobSpec.parse(data), tenant,
                                                               limits))

        with self._steps.inserting():
            array, record = self._repo.insert_fanout(tenant.id, name, items, merge_spec,
                                                     now=utcnow(), max_queued=limits.max_queued)
        log.info("fanout_submitted job=%s array=%s tenant=%s items=%d", record.id, array.id,
                 tenant.name, array.size)
        self._steps.wake(record.id)
        return record

    def dry_run(self, tenant: TenantRecord, spec: JobSpec,
                limits: TenantLimits) -> dict[str, Any]:
        """What `submit` would store: the merge job's name, how many chunks, the files and
        their frames."""
        items, merge = self._specs(tenant, spec, limits)
        return {"dry_run": True, "name": merge["name"], "fanout": {
            "items": len(items), "files": merge["params"]["files"],
            "total_frames": merge["params"]["total_frames"]}}

    def _specs(self, tenant: TenantRecord, spec: JobSpec, limits: TenantLimits
               ) -> tuple[list[tuple[JobSpec, Route]], dict[str, Any]]:
        """The chunk jobs (validated, checked, routed, within the caps on one request) and the
        merge job's spec fields, but for its `after` and input (the array's id)."""
        if spec.after:
            raise SpecError.one("after", "a footage source's fan-out takes no after: submit "
                                         "it once what it needs has succeeded")
        planned = plan_fanout(spec.params, roots=self._settings.input_file_roots,
                              allowed=self._settings.input_allowed_networks)
        most = min(MAX_ARRAY_ITEMS, limits.max_array_items)
        if len(planned.items) > most:
            raise SpecError.one("params.chunk_s", f"{len(planned.items)} chunks; at most {most} "
                                                  "in one array: a longer chunk_s")
        base = spec.model_dump(mode="json", exclude_defaults=True)
        name = spec.name or "footage"
        steps = self._steps
        tally = steps.tally(field="params.source")
        nodes = steps.nodes()
        items: list[tuple[JobSpec, Route]] = []
        memo: Memo = {}
        for i, item in enumerate(planned.items):
            data = {**base, "name": f"{name[:NAME_MAX - 8]}[{i}]", "params": item["params"],
                    "inputs": {**spec.inputs, **item["inputs"]}}
            chunk = steps.within_limits(JobSpec.parse(data), tenant, limits)
            steps.check_bundles(tenant, chunk, memo=memo)
            steps.check_secrets(tenant, chunk)
            tally.add(chunk)
            items.append(steps.place(chunk, nodes))
        merge = {**{k: v for k, v in base.items() if k not in ("params", "inputs", "after")},
                 "name": name, "entrypoint": MERGE_ENTRYPOINT, "params": planned.merge["params"],
                 "resources": {"gpus": 0}}
        return items, merge
