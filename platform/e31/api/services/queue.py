"""The shared pool's queues as a tenant may see them (`GET /v1/queue`, `e31.api.routes.queue`):
per size class, GPUs, busy GPUs, queued jobs and running GPUs per tenant, each tenant's share of
running GPUs against its share of weight. Only an admin's token sees other tenants by name.
"""

from __future__ import annotations

from typing import Any

from e31.api.services.readings import PoolReadings
from e31.core.clock import utcnow
from e31.core.records import TenantRecord
from e31.edge.settings import Settings
from e31.scheduling import explain
from e31.store import Repo


class QueueService:
    """The queue view, over one store and view of the pool."""

    def __init__(self, *, settings: Settings, repo: Repo, readings: PoolReadings) -> None:
        self._settings = settings
        self._repo = repo
        self._readings = readings

    def overview(self, tenant: TenantRecord) -> dict[str, Any]:
        """Per size class: GPUs, busy GPUs, queued jobs and running GPUs per tenant, share used
        against weight. Only an admin token sees other tenants by name."""
        view = self._readings.view(utcnow())
        overview = explain.queue_overview(
            classes=self._settings.size_classes, workers=self._readings.workers(expand=False),
            view=view, tenants=self._readings.tenant_views(view),
            queued=self._repo.queued_by_tenant(), viewer=None if tenant.admin else tenant.id)
        # Nodes out of service until their worker starts again: an operator's drain, or a
        # node's own for a GPU's XID error, with the reason.
        overview["drained"] = [d.to_dict() for d in self._repo.drained_nodes()]
        return overview
