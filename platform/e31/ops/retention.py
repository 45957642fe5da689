"""The retention policy behind `e31 gc`: the artifacts (outputs, logs, checkpoints) of jobs
that ended more than `artifact_retention_days` ago are removed; the job rows stay, so their
status still answers, with an empty outputs list (docs/operations.md, "Artifact retention").

A dry run (the default) only measures what would go. A deletion removes a job's files first
and then records it in the store (its outputs list emptied, its bytes given back to its
tenant's outputs total), so a run cut short is finished by the next one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol

from e31.edge.artifacts import ArtifactStore, Footprint

log = logging.getLogger(__name__)

PAGE_JOBS = 500          # ended jobs read from the store at a time
SECONDS_PER_DAY = 86400


class EndedJobRow(Protocol):
    id: str
    tenant_id: str
    ended_at: datetime


class RetentionStore(Protocol):
    """What the policy needs of the results store (`e31.store.Repo` has it)."""

    def ended_jobs(self, *, ended_before: datetime, after_id: str = "",
                   limit: int) -> list[Any]: ...

    def mark_artifacts_removed(self, job_id: str, *, now: datetime,
                               freed_outputs_bytes: int) -> None: ...


@dataclass(frozen=True)
class Collected:
    """One job whose artifacts were (or, in a dry run, would be) removed."""

    job_id: str
    tenant_id: str
    ended_at: datetime
    files: int
    bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.job_id, "tenant_id": self.tenant_id,
                "ended_at": self.ended_at.isoformat(), "files": self.files, "bytes": self.bytes}


@dataclass
class GcReport:
    """What a run of the policy found, and whether it deleted it."""

    older_than_days: float
    cutoff: datetime | None      # None: retention 0, nothing is ever removed
    deleted: bool
    jobs: list[Collected] = field(default_factory=list)

    @property
    def files(self) -> int:
        return sum(j.files for j in self.jobs)

    @property
    def bytes(self) -> int:
        return sum(j.bytes for j in self.jobs)

    def to_dict(self) -> dict[str, Any]:
        return {"older_than_days": self.older_than_days, "deleted": self.deleted,
                "cutoff": self.cutoff.isoformat() if self.cutoff else None,
                "job_count": len(self.jobs), "files": self.files, "bytes": self.bytes,
                "jobs": [j.to_dict() for j in self.jobs]}


def collect(store: RetentionStore, artifacts: ArtifactStore, *, older_than_days: float,
            now: datetime, delete: bool) -> GcReport:
    """Measure, and with `delete` remove, the artifacts of every job that ended more than
    `older_than_days` before `now`; 0 days keeps everything (nothing is listed)."""
    if older_than_days < 0:
        raise ValueError("older_than_days must be >= 0")
    if older_than_days == 0:
        return GcReport(older_than_days, None, delete)
    cutoff = now - timedelta(seconds=older_than_days * SECONDS_PER_DAY)
    report = GcReport(older_than_days, cutoff, delete)
    for job in _ended(store, cutoff):
        if delete:
            found = artifacts.remove_job(job.tenant_id, job.id)
            store.mark_artifacts_removed(job.id, now=now, freed_outputs_bytes=found.outputs_bytes)
            log.info("artifacts_removed job=%s tenant=%s files=%d bytes=%d", job.id,
                     job.tenant_id, found.files, found.bytes)
        else:
            found = artifacts.footprint(job.tenant_id, job.id)
        report.jobs.append(_collected(job, found))
    return report


def _ended(store: RetentionStore, cutoff: datetime) -> Iterator[EndedJobRow]:
    """Every job that ended before `cutoff` with its artifacts kept, a page at a time."""
    after = ""
    while True:
        page = store.ended_jobs(ended_before=cutoff, after_id=after, limit=PAGE_JOBS)
        yield from page
        if len(page) < PAGE_JOBS:
            return
        after = page[-1].id


def _collected(job: EndedJobRow, found: Footprint) -> Collected:
    return Collected(job.id, job.tenant_id, job.ended_at, found.files, found.bytes)
