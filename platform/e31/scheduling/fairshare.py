"""Fair share between tenants: the admission order key, quotas and pending reasons.

Pure logic for the scheduler: no I/O, no clock. Every time is a float of seconds
(`now_s`, `submitted_at_s`; the caller passes `datetime.timestamp()`), so the same code
runs in the live scheduler, in unit tests with a simulated clock and in `bench/fairness`.
`e31.scheduling.admission.decide` uses these pieces to choose what to publish in one tick.

Order within a class: priority band (higher first), then the tenant furthest below its fair
share (`share_key`, lower first), then age. See docs/scheduling.md for why.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum

LN2 = math.log(2.0)
DEFAULT_RESERVE_AFTER_S = 600.0     # a blocked big job waits this long before it reserves GPUs
BIG_JOB_MIN_GPUS = 2                # "big" = a multi-GPU job (queue e31.<class>.xN)
SECONDS_PER_MIN = 60.0


def share_key(usage_gpu_s: float, running_gpus: int, weight: float, half_life_s: float) -> float:
    """How far above its fair share a tenant is: lower goes first.

    (decayed usage + running GPUs × mean life) / weight. Ordering by usage/weight is ordering
    by usage / fair share, since every tenant's fair share is weight × the same total. A
    running GPU adds what it would add to the decayed usage if it kept running (half-life /
    ln 2 per GPU: the steady state of a GPU charged continuously): this blends history (SLURM)
    with the current allocation, and makes a GPU admitted in this tick count at once, so one
    tick does not hand every idle slot to the same tenant.
    """
    return (usage_gpu_s + running_gpus * half_life_s / LN2) / weight


@dataclass(frozen=True)
class Tenant:
    """A tenant as the policy sees it at `now_s`."""

    name: str
    weight: float = 1.0
    quotas: Mapping[str, int] = field(default_factory=dict)        # size class -> most GPUs at once
    usage_gpu_s: float = 0.0                                       # UsageState.at(now_s, …)
    running_gpus: Mapping[str, int] = field(default_factory=dict)  # size class -> GPUs running
    #                                                                or published, not yet claimed
    disabled: bool = False    # an admin disabled the tenant: none of its jobs starts

    def __post_init__(self) -> None:
        if self.weight <= 0:
            raise ValueError(f"tenant {self.name}: weight must be positive")

    def running_total(self) -> int:
        return sum(self.running_gpus.values())

    def key(self, half_life_s: float) -> float:
        return share_key(self.usage_gpu_s, self.running_total(), self.weight, half_life_s)

    def fits_quota(self, size_class: str, gpus: int) -> bool:
        """Whether `gpus` more GPUs of `size_class` keep the tenant within its quota."""
        if self.disabled:      # held as by a quota of 0 of every class (reserving nothing)
            return False
        quota = self.quotas.get(size_class)
        return quota is None or self.running_gpus.get(size_class, 0) + gpus <= quota

    def with_admitted(self, size_class: str, gpus: int) -> Tenant:
        """The view after one more job of `gpus` GPUs is published in this tick."""
        running = dict(self.running_gpus)
        running[size_class] = running.get(size_class, 0) + gpus
        return replace(self, running_gpus=running)


class Reason(StrEnum):
    """Why a queued job is still waiting."""

    NO_CAPACITY = "no_capacity"    # detail: size class
    QUOTA = "quota"                # detail: size class
    RESERVED_FOR = "reserved_for"  # detail: the big job holding the reservation
    DEPENDENCY = "dependency"      # detail: the job not finished (the caller sets it)
    BACKOFF = "backoff"            # detail: ISO time of not_before (the caller sets it)
    TENANT_DISABLED = "tenant_disabled"   # detail: empty; an admin disabled the tenant


@dataclass(frozen=True)
class Pending:
    """A pending reason with its detail, and the sentence a person reads."""

    reason: Reason
    detail: str
    gpus: int = 1

    def text(self) -> str:
        if self.reason is Reason.NO_CAPACITY:
            if self.gpus > 1:
                return f"waiting for {self.gpus} free {self.detail} GPUs on one worker"
            return f"waiting for a free {self.detail} {'slot' if self.gpus == 0 else 'GPU'}"
        if self.reason is Reason.QUOTA:
            return f"tenant quota for {self.detail} reached"
        if self.reason is Reason.RESERVED_FOR:
            return f"GPUs reserved for the waiting multi-GPU job {self.detail}"
        if self.reason is Reason.TENANT_DISABLED:
            return "the tenant is disabled; an admin's `e31 tenant enable` resumes its jobs"
        if self.reason is Reason.DEPENDENCY:
            return f"dependency {self.detail} not finished"
        return f"retry back-off until {self.detail}"


def quota_pending(tenant: Tenant, size_class: str, gpus: int) -> Pending:
    """Why a job that its tenant's quota holds back waits: the quota, or the tenant disabled."""
    if tenant.disabled:
        return Pending(Reason.TENANT_DISABLED, "", gpus)
    return Pending(Reason.QUOTA, size_class, gpus)


def position_in_queue(*, tenant: str, priority: int, older_own: int,
                      backlog: Mapping[tuple[str, int], int], tenants: Mapping[str, Tenant],
                      half_life_s: float) -> int:
    """Jobs expected to start before this one in its queue (0: it is next).

    `backlog` is the queue's queued jobs per (tenant, priority), a GROUP BY, and `older_own`
    the tenant's older jobs in the same band: no scan of the backlog. Higher bands go first;
    in the same band tenants interleave in proportion to weight (what the share key does in
    a steady state), and a tenant below this one's share key also goes first for one turn.
    """
    own = tenants.get(tenant, Tenant(tenant))
    own_key = own.key(half_life_s)
    ahead = older_own
    for (name, band), count in backlog.items():
        if band > priority:
            ahead += count
        elif band == priority and name != tenant:
            other = tenants.get(name, Tenant(name))
            turns = older_own + (1 if other.key(half_life_s) < own_key else 0)
            ahead += min(count, math.ceil(turns * other.weight / own.weight))
    return ahead


def estimated_start_s(now_s: float, position: int, starts_per_min: float) -> float | None:
    """When the job should start at the recent rate of starts in its queue; None if none."""
    if starts_per_min <= 0:
        return None
    return now_s + (position + 1) * SECONDS_PER_MIN / starts_per_min
