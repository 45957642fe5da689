"""The shared pool's queues as a tenant may see them (`GET /v1/queue`, `e31.api.routes.queue`):
per size class, GPUs, busy GPUs, queued jobs and running slots (GPUs, or a CPU class's jobs) per
tenant, each tenant's share of them against its share of weight. Only an admin's token sees
other tenants by name.

And the Python environments of the live workers that would run a job of given resources
(`GET /v1/pool/environments`): what `@e31.function` checks a call against before it stores
a job (docs/notebooks.md, "How a call travels").
"""

from __future__ import annotations

from typing import Any

from e31.api.services.readings import PoolReadings
from e31.core.clock import utcnow
from e31.core.errors import SpecError
from e31.core.functioncalls import FUNCTION_ENTRYPOINT
from e31.core.records import TenantRecord
from e31.core.sizeclasses import route
from e31.core.spec import JobSpec
from e31.edge.settings import Settings
from e31.ops.heartbeat import WorkerInfo
from e31.scheduling import explain
from e31.store import Repo


class QueueService:
    """The queue view, over one store and view of the pool."""

    def __init__(self, *, settings: Settings, repo: Repo, readings: PoolReadings) -> None:
        self._settings = settings
        self._repo = repo
        self._readings = readings

    def overview(self, tenant: TenantRecord) -> dict[str, Any]:
        """Per size class: GPUs, busy GPUs, queued jobs and running slots (GPUs, or a CPU
        class's jobs) per tenant, share used against weight. Only an admin token sees other
        tenants by name."""
        view = self._readings.view(utcnow())
        overview = explain.queue_overview(
            classes=self._settings.size_classes, workers=self._readings.workers(expand=False),
            view=view, tenants=self._readings.tenant_views(view),
            queued=self._repo.queued_by_tenant(), running=self._readings.running_slots(view),
            viewer=None if tenant.admin else tenant.id)
        # Nodes out of service until their worker starts again: an operator's drain, or a
        # node's own for a GPU's XID error, with the reason.
        overview["drained"] = [d.to_dict() for d in self._repo.drained_nodes()]
        return overview

    def environments(self, resources: dict[str, Any]) -> dict[str, Any]:
        """The distinct Python environments of the live workers serving the queue a job of
        `resources` is routed to (Python, packages, importable top-level modules), each with
        how many workers have it; `unknown` counts those whose environment is not known (an
        older worker, a record Redis lost), which a caller must not judge by the others.
        Resources no class takes run nowhere: no environment, and `refused` says why (the
        submission of such a job is refused the same way)."""
        try:
            spec = JobSpec.parse({"entrypoint": FUNCTION_ENTRYPOINT, "resources": resources})
            where = route(spec, self._settings.size_classes)
        except SpecError as exc:
            return {"size_class": None, "queue": None, "workers": 0, "unknown": 0,
                    "environments": [], "refused": str(exc)}
        serving = [w for w in self._readings.workers(expand=False) or ()
                   if _serves(w, where.queue)]
        known = self._readings.environments(serving) or {}
        counts: dict[str, int] = {}
        for w in serving:
            if w.pyenv in known:
                counts[w.pyenv] = counts.get(w.pyenv, 0) + 1
        return {"size_class": where.size_class, "queue": where.queue, "workers": len(serving),
                "unknown": len(serving) - sum(counts.values()),
                "environments": [_environment(d, n, known[d]) for d, n in sorted(counts.items())]}


def _environment(digest: str, workers: int, env: dict[str, Any]) -> dict[str, Any]:
    """One environment as the route answers it; `modules` (the top-level modules its workers
    can import) only when they listed them: an older worker's is not judged on modules."""
    out: dict[str, Any] = {"digest": digest, "workers": workers, "python": env.get("python"),
                           "packages": env.get("packages") or {}}
    if isinstance(env.get("modules"), list):
        out["modules"] = env["modules"]
    return out


def _serves(worker: WorkerInfo, queue: str) -> bool:
    """Whether `worker` consumes `queue`: its own or a spill queue, or a gang worker's sets'."""
    return queue in worker.queues or any(queue in queues for _, queues in worker.gang)
