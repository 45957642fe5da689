"""One tick's admission decision: which queued jobs to publish now, and why the rest wait.

Pure: the caller passes the capacity (worker slots), the tenants' fair-share view
and, per queue, a bounded head of candidates (the oldest K per tenant per priority band),
so the cost of a decision depends on the pool and K, never on the backlog.

Capacity model. A `Slot` is one worker: it consumes `queues` in preference order and pins
`gpu_ids`. A slot is free when it is idle and none of its GPUs is held by a busy or newly
filled slot. The live launcher's slots never share GPUs (static groups); a node that
advertises one-GPU slots and .x4 slots over the same GPUs also works (a job takes k GPUs of
one node), and that is where the reservation matters. See docs/scheduling.md.

Placement goes level by level: first every free slot takes work from its own queue
(`queues[0]`), then from its first spill queue, and so on, so a big worker prefers its own
class (docs/scheduling.md). Within a level, jobs compete in fair order: priority band, share
key, age. A big job waiting longer than `reserve_after_s` goes first; if nothing can take
it, it reserves the slot whose GPUs free up earliest (by the running jobs' timeout_s), and
other work may use those GPUs only if its own timeout_s ends before then (backfill).
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from e31.core.records import Candidate
from e31.core.usage import DEFAULT_HALF_LIFE_S
from e31.scheduling.fairshare import (
    BIG_JOB_MIN_GPUS,
    DEFAULT_RESERVE_AFTER_S,
    Pending,
    Reason,
    Tenant,
    quota_pending,
)


@dataclass(frozen=True)
class Slot:
    """One worker slot. Busy slots carry when they should be free: started_at + timeout_s."""

    node: str
    queues: tuple[str, ...]
    gpu_ids: frozenset[str] = frozenset()   # e.g. {"host:0", "host:1"}; empty for cpu
    busy: bool = False
    free_at_s: float = math.inf             # busy slots only; inf when unknown
    rank: int = 0                           # among equally shared slots, lower is filled first

    @property
    def gpu_count(self) -> int:
        return len(self.gpu_ids)


@dataclass(frozen=True)
class AdmissionConfig:
    """The policy's knobs. `spill_max_s` bounds the timeout_s of work a slot takes from a
    queue other than its own (None: no bound), so a big worker busy with spilled one-GPU
    work frees up for its own class within that time."""

    half_life_s: float = DEFAULT_HALF_LIFE_S
    reserve_after_s: float = DEFAULT_RESERVE_AFTER_S
    big_job_min_gpus: int = BIG_JOB_MIN_GPUS
    spill_max_s: float | None = None


@dataclass(frozen=True)
class Dispatch:
    """Publish `job_id` to `queue`; `node` is the slot the policy counted it against."""

    job_id: str
    queue: str
    node: str


@dataclass(frozen=True)
class Reservation:
    """GPUs held for one big job from now until `start_s` (when they should all be free)."""

    job_id: str
    node: str
    gpu_ids: frozenset[str]
    start_s: float


@dataclass(frozen=True)
class Decision:
    """What to publish now, in order, and why each other candidate waits."""

    publish: tuple[Dispatch, ...]
    pending: Mapping[str, Pending]        # every candidate not published
    reservation: Reservation | None
    steps: int = 0                        # candidates and slots examined: the cost measure


# (order key, version, stream)
_Entry = tuple[tuple[int, float, tuple[float, float, str]], int, list[Candidate]]


@dataclass
class _Tick:
    """Mutable state of one decision; never escapes `decide`."""

    now_s: float
    cfg: AdmissionConfig
    tenants: dict[str, Tenant]
    held: dict[str, float] = field(default_factory=dict)     # GPU id -> free at
    taken: dict[str, float] = field(default_factory=dict)    # slot busy or filled -> free at
    versions: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    reservation: Reservation | None = None
    reserved_blocked: set[str] = field(default_factory=set)
    publish: list[Dispatch] = field(default_factory=list)
    placed: set[str] = field(default_factory=set)
    steps: int = 0

    def free(self, slot: Slot) -> bool:
        return slot.node not in self.taken and not any(g in self.held for g in slot.gpu_ids)

    def start_of(self, slot: Slot) -> float:
        """When the slot and all of its GPUs should be free (now if they are)."""
        return max([self.now_s, self.taken.get(slot.node, self.now_s),
                    *(self.held.get(g, self.now_s) for g in slot.gpu_ids)])

    def clashes(self, slot: Slot, job: Candidate | None) -> bool:
        """Whether `job` on `slot` would delay the reservation."""
        r = self.reservation
        if job is None or r is None or r.job_id == job.id:
            return False
        if not (slot.gpu_ids & r.gpu_ids or slot.node == r.node):
            return False
        return self.now_s + job.timeout_s > r.start_s

    def fill(self, slot: Slot, free_at_s: float, job: Candidate | None = None) -> None:
        """Mark the slot and its GPUs used until `free_at_s`; publish `job` if given."""
        self.taken[slot.node] = free_at_s
        for g in slot.gpu_ids:
            self.held[g] = max(self.held.get(g, self.now_s), free_at_s)
        if job is not None:
            self.placed.add(job.id)
            self.publish.append(Dispatch(job.id, job.queue, slot.node))
            self.tenants[job.tenant_id] = self._tenant(job.tenant_id).with_admitted(
                job.size_class, job.gpus)
            self.versions[job.tenant_id] += 1

    def _tenant(self, name: str) -> Tenant:
        return self.tenants.get(name) or Tenant(name)

    def key(self, job: Candidate) -> tuple[int, float, tuple[float, float, str]]:
        return (-job.priority, self._tenant(job.tenant_id).key(self.cfg.half_life_s),
                job.order)

    def fits_quota(self, job: Candidate) -> bool:
        return self._tenant(job.tenant_id).fits_quota(job.size_class, job.gpus)

    def find(self, slots: Iterable[Slot], job: Candidate | None) -> tuple[Slot | None, bool]:
        """A free slot for `job` (best first), and whether any free slot existed at all."""
        any_free = False
        for slot in slots:
            self.steps += 1
            if self.free(slot):
                any_free = True
                if not self.clashes(slot, job):
                    return slot, True
        return None, any_free


def _overlaps(slots: Sequence[Slot]) -> dict[str, int]:
    """Per slot, how many other slots share one of its GPUs: fill the least shared first."""
    per_gpu: dict[str, int] = defaultdict(int)
    for s in slots:
        for g in s.gpu_ids:
            per_gpu[g] += 1
    return {s.node: sum(per_gpu[g] - 1 for g in s.gpu_ids) for s in slots}


def decide(*, now_s: float, slots: Sequence[Slot], tenants: Mapping[str, Tenant],
           heads: Mapping[str, Sequence[Candidate]],
           outstanding: Mapping[str, int] | None = None,
           config: AdmissionConfig = AdmissionConfig(),
           outstanding_timeout_s: Mapping[str, Sequence[float]] | None = None) -> Decision:
    """Choose what to publish now; give every other candidate in `heads` a pending reason.

    `heads` maps a queue to its candidates, each tenant's oldest K per priority band (any
    order). `outstanding` counts messages published and not yet claimed per queue: each
    uses a free slot of that queue first (their tenants' GPUs belong in `running_gpus`).
    `outstanding_timeout_s` optionally gives those messages' jobs' timeout_s per queue, so
    the slot they hold counts as free again by then (else: not known), and a reservation
    is not pushed to infinity by a job backfilled in an earlier tick.
    """
    t = _Tick(now_s=now_s, cfg=config, tenants=dict(tenants))
    for s in slots:
        if s.busy:
            t.fill(s, s.free_at_s)
    overlap = _overlaps(slots)
    levels: dict[tuple[str, int], list[Slot]] = defaultdict(list)
    for s in sorted(slots, key=lambda s: (overlap[s.node], s.rank, s.node)):
        for level, queue in enumerate(s.queues):
            levels[(queue, level)].append(s)
    depth = max((len(s.queues) for s in slots), default=0)

    def by_queue(queue: str) -> list[Slot]:
        return [s for level in range(depth) for s in levels.get((queue, level), [])]

    for queue, n in (outstanding or {}).items():
        bounds = sorted((outstanding_timeout_s or {}).get(queue, ()), reverse=True)
        for i in range(n):
            slot = t.find(by_queue(queue), None)[0]
            if slot is not None:   # when its job will end: at the latest its timeout from now
                t.fill(slot, now_s + bounds[i] if i < len(bounds) else math.inf)

    jobs = [j for queue_jobs in heads.values() for j in queue_jobs]
    _serve_overdue_big_jobs(t, jobs, by_queue)
    for level in range(depth):
        _serve_level(t, level, heads, levels)

    pending: dict[str, Pending] = {}
    for j in jobs:
        if j.id in t.placed:
            continue
        if not t.fits_quota(j):
            pending[j.id] = quota_pending(t._tenant(j.tenant_id), j.size_class, j.gpus)
        elif j.id in t.reserved_blocked and t.reservation is not None:
            pending[j.id] = Pending(Reason.RESERVED_FOR, t.reservation.job_id, j.gpus)
        else:
            pending[j.id] = Pending(Reason.NO_CAPACITY, j.size_class, j.gpus)
    return Decision(tuple(t.publish), pending, t.reservation, t.steps)


def _serve_overdue_big_jobs(t: _Tick, jobs: Sequence[Candidate],
                            by_queue: Callable[[str], list[Slot]]) -> None:
    """Start big jobs waiting past `reserve_after_s`, oldest first; reserve for the first
    that cannot start (quota-blocked ones reserve nothing: they could not use it)."""
    overdue = sorted((j for j in jobs if j.gpus >= t.cfg.big_job_min_gpus
                      and t.now_s - j.submitted_at_s >= t.cfg.reserve_after_s),
                     key=lambda j: (-j.priority, j.submitted_at_s, j.id))
    for job in overdue:
        t.steps += 1
        if not t.fits_quota(job):
            continue
        candidates = by_queue(job.queue)
        slot, _ = t.find(candidates, job)
        if slot is not None:
            t.fill(slot, t.now_s + job.timeout_s, job)
            continue
        if candidates:
            best = min(candidates, key=lambda s: (t.start_of(s), s.node))
            t.reservation = Reservation(job.id, best.node, best.gpu_ids, t.start_of(best))
        return


def _serve_level(t: _Tick, level: int, heads: Mapping[str, Sequence[Candidate]],
                 levels: Mapping[tuple[str, int], list[Slot]]) -> None:
    """Fill free slots from the queue each holds at `level`, in fair order across queues."""
    heap: list[_Entry] = []
    for queue, queue_jobs in heads.items():
        if not any(t.free(s) for s in levels.get((queue, level), [])):
            continue
        streams: dict[tuple[str, int], list[Candidate]] = defaultdict(list)
        for j in queue_jobs:
            if j.id not in t.placed:
                streams[(j.tenant_id, j.priority)].append(j)
        for stream in streams.values():
            stream.sort(key=lambda j: j.order, reverse=True)  # pop() = due first, then oldest
            _push(heap, t, stream)
    full: set[str] = set()
    spill_max_s = t.cfg.spill_max_s if level > 0 else None
    while heap:
        _, version, stream = heapq.heappop(heap)
        job = stream[-1]
        t.steps += 1
        if job.queue in full or not t.fits_quota(job):  # quota: the whole stream (same size)
            continue
        if version != t.versions[job.tenant_id]:       # the tenant got a job since: re-rank
            _push(heap, t, stream)
            continue
        if spill_max_s is not None and job.timeout_s > spill_max_s:
            stream.pop()                                # too long to spill; a later one may fit
        else:
            slot, any_free = t.find(levels.get((job.queue, level), []), job)
            if not any_free:
                full.add(job.queue)
                continue
            stream.pop()
            if slot is None:
                t.reserved_blocked.add(job.id)
            else:
                t.fill(slot, t.now_s + job.timeout_s, job)
        _push(heap, t, stream)


def _push(heap: list[_Entry], t: _Tick, stream: list[Candidate]) -> None:
    """Queue a stream's oldest job at its tenant's current standing."""
    if stream:
        heapq.heappush(heap, (t.key(stream[-1]), t.versions[stream[-1].tenant_id], stream))
