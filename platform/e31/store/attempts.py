"""Facts a worker notes on an attempt while it runs: its isolation, how its child started,
how long its setup took, what it used of its GPUs, the limits it ran under. A mixin of
`Repo` (which supplies `_session`), so there is one repository to pass around.

The columns are nullable: an attempt started before they existed, or one whose worker did not
get as far as measuring, shows null ("not known"), never a made-up zero.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from e31.core.errors import StoreError
from e31.core.states import Isolation, JobState, Start
from e31.store.models import Attempt, Job


@dataclass(frozen=True)
class AttemptFacts:
    """What one note sets on an attempt row; a field left None is left as it was."""

    isolation: Isolation | None = None
    start: Start | None = None
    start_ms: float | None = None           # from fork/exec to the child running
    setup_s: float | None = None            # bundle, environment and inputs; never billed
    gpu_mem_peak_gb: float | None = None
    gpu_util_mean: float | None = None      # percent, 0..100
    # The limits it runs under: {"pids_max", "mem_gb", "disk_gb"[, "network"]}, each None
    # where not applied (e31_worker.attempt.limits).
    limits: dict[str, Any] | None = None

    def values(self) -> dict[str, object]:
        """The columns to write: the fields that are set, enums as their wire strings."""
        out: dict[str, object] = {}
        for name, value in asdict(self).items():
            if value is None:
                continue
            if isinstance(value, float | int) and not isinstance(value, bool) and value < 0:
                raise StoreError(f"attempt fact {name} cannot be negative: {value}")
            out[name] = value.value if isinstance(value, Isolation | Start) else value
        return out


class AttemptQueries:
    """The attempt facts' part of `Repo`."""

    def _session(self, *, write: bool = False) -> AbstractContextManager[Session]:
        raise NotImplementedError

    def note_attempt(self, job_id: str, attempt: int, facts: AttemptFacts) -> bool:
        """Set `facts` on attempt `attempt` of `job_id`; False when there is no such attempt.

        Not fenced by the lease: the row is this attempt's own, and what it notes describes
        how it ran, whoever records its outcome.
        """
        values = facts.values()
        if not values:
            return True
        with self._session(write=True) as s:
            res = s.execute(update(Attempt).where(Attempt.job_id == job_id,
                                                  Attempt.n == attempt).values(**values))
            return bool(res.rowcount)  # type: ignore[attr-defined]

    def mark_idle(self, job_id: str, attempt: int, since: datetime | None) -> bool:
        """Flag attempt `attempt` of `job_id` idle since `since` (its watchdog saw no log,
        progress or GPU use move for its idle_timeout_s), or clear the flag (None) when it
        moves again; False when there is no such attempt."""
        with self._session(write=True) as s:
            res = s.execute(update(Attempt).where(Attempt.job_id == job_id,
                                                  Attempt.n == attempt).values(idle_since=since))
            return bool(res.rowcount)  # type: ignore[attr-defined]

    def idle_jobs(self) -> dict[str, int]:
        """Running jobs flagged idle, per size class (the metric `e31_jobs_idle`)."""
        with self._session() as s:
            rows = s.execute(
                select(Job.size_class, func.count())
                .join(Attempt, (Attempt.job_id == Job.id) & (Attempt.n == Job.attempts_used))
                .where(Job.state == JobState.RUNNING.value, Attempt.idle_since.is_not(None),
                       Attempt.ended_at.is_(None))
                .group_by(Job.size_class))
            return {str(cls): int(n) for cls, n in rows}
