"""Column values and small helpers shared by the repository's parts."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from e31.core.sizeclasses import Route
from e31.core.spec import JobSpec
from e31.core.states import JobState

CHUNK = 500   # ids per `IN (...)`: well under any backend's bind limit


def new_job_id() -> str:
    return "j-" + uuid.uuid4().hex[:20]


def new_array_id() -> str:
    return "a-" + uuid.uuid4().hex[:20]


def queued_job(tenant_id: str, spec: JobSpec, route: Route, now: datetime) -> dict[str, Any]:
    """The column values of a newly submitted job (one or an array's item)."""
    return {"id": new_job_id(), "tenant_id": tenant_id, "name": spec.display_name,
            "spec": spec.model_dump(mode="json"), "size_class": route.size_class,
            "queue": route.queue, "gpus": route.gpus, "priority": spec.priority,
            "timeout_s": spec.timeout_s, "deps_pending": 0,
            "state": JobState.QUEUED.value, "submitted_at": now, "queued_since": now,
            "dispatch_count": 0, "attempts_used": 0, "lease_token": 0, "cancel_requested": False,
            "preemptible": spec.is_preemptible,
            "gpu_seconds": 0.0, "run_seconds": 0.0, "queued_seconds": 0.0}


def seconds(start: datetime | None, end: datetime) -> float:
    return max(0.0, (end - start).total_seconds()) if start else 0.0
