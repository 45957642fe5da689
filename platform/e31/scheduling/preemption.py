"""Preemption: which running jobs to stop so that a waiting job gets its GPUs (issue 15,
docs/scheduling.md "Preemption").

Pure, like `admission`: the scheduler passes the worker slots, the running jobs, the jobs
waiting for capacity and the tenants' weights; `plan` answers which running jobs to preempt
now. The scheduler marks them (`SchedulingStore.request_preemption`); each one's worker sees
it at its next lease renewal, sends the job SIGTERM and its grace to checkpoint, and the job is
requeued with reason `preempted` (not counted against its retries) to resume later.

The rule. A job that has waited `grace_s` since it was last queued, for lack of capacity, may
preempt when its tenant is below its fair share or when a job of a lower priority band holds
the GPUs. Victims are preemptible jobs of other tenants that are over their fair share (each
taken while its tenant still is), that have run at least `min_runtime_s` in their attempt (so
nothing thrashes), and whose stop frees a whole worker slot that can take the waiting job (on
a gang host, a GPU set: the jobs holding any of its GPUs are stopped): the plan picks the
slot that needs the fewest victims (then the fewest GPUs stopped). A slot whose every job is
already being preempted counts as freeing: the waiting job is served by it instead of
preempting again. Non-preemptible jobs are never chosen.

Fair shares here are of the pool's GPUs right now: each tenant with running or waiting GPU
work gets weight / (sum of those tenants' weights) of them, as `bench/fairness/nodes.py`
simulates (figures in docs/scheduling.md). Preemption is for GPUs: a cpu-class job neither
preempts nor is preempted.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from e31.core.records import RunningJob
from e31.ops.heartbeat import gang_place
from e31.scheduling.admission import Slot
from e31.scheduling.inputs import HEADROOM_NODE, held_set

DEFAULT_GRACE_S = 900.0          # how long a job waits before it may preempt
DEFAULT_MIN_RUNTIME_S = 900.0    # how long an attempt runs before it may be preempted
MAX_PREEMPTORS_PER_TICK = 2      # waiting jobs that start a preemption in one tick


@dataclass(frozen=True)
class PreemptConfig:
    """The knobs (`[scheduler]` settings preempt_grace_s, preempt_min_runtime_s). A grace of
    None turns preemption off."""

    grace_s: float | None = DEFAULT_GRACE_S
    min_runtime_s: float = DEFAULT_MIN_RUNTIME_S
    max_per_tick: int = MAX_PREEMPTORS_PER_TICK


@dataclass(frozen=True)
class Waiter:
    """A job waiting for capacity: a pending head, or published and not yet taken."""

    id: str
    tenant_id: str
    queue: str
    gpus: int
    priority: int
    queued_since_s: float


@dataclass(frozen=True)
class Preemption:
    """Stop `victims` (running job ids) so that `for_job` can have the slot `node`."""

    for_job: str
    node: str
    victims: tuple[str, ...]


def fair_shares(weights: Mapping[str, float], active: Sequence[str],
                capacity: int) -> dict[str, float]:
    """Each active tenant's share of `capacity` by weight (a tenant without a weight: 1)."""
    total = sum(weights.get(t, 1.0) for t in active) or 1.0
    return {t: weights.get(t, 1.0) / total * capacity for t in active}


def plan(*, now_s: float, slots: Sequence[Slot], running: Sequence[RunningJob],
         waiting: Sequence[Waiter], weights: Mapping[str, float],
         config: PreemptConfig) -> list[Preemption]:
    """The preemptions to ask for now (see the module's docstring); [] when none is due."""
    grace_s = config.grace_s
    if grace_s is None or not any(w.gpus > 0 and now_s - w.queued_since_s >= grace_s
                                  for w in waiting):
        return []      # the common tick: nobody waited long enough, nothing else to work out
    real = [s for s in slots if not s.node.startswith(HEADROOM_NODE)]   # workers, not headroom
    gang_hosts = {place[0] for s in real if (place := gang_place(s.node)) is not None}
    # each running job on the slot it holds: a gang host's job on its GPU set
    on_slot = {held_set(r, gang_hosts) or r.node: r for r in running if r.node and r.lease_live}
    held: dict[str, int] = defaultdict(int)
    for r in on_slot.values():
        if not r.preempt_requested and r.gpus:    # one asked to stop is as good as gone
            held[r.tenant_id] += r.gpus
    waiting = [w for w in waiting if w.gpus > 0]
    for w in waiting:
        held.setdefault(w.tenant_id, 0)
    share = fair_shares(weights, sorted(held), len({g for s in real for g in s.gpu_ids}))
    over = {t: held[t] - share[t] for t in held}      # GPUs held beyond the share
    sharing = _sharing(real)
    spoken: set[str] = set()                          # slots already given to a waiter
    out: list[Preemption] = []

    def order(w: Waiter) -> tuple[float, ...]:
        return (-w.priority, held[w.tenant_id] / weights.get(w.tenant_id, 1.0),
                w.queued_since_s)

    for w in sorted(waiting, key=lambda w: (*order(w), w.id)):
        if len(out) >= config.max_per_tick:
            break
        if now_s - w.queued_since_s < grace_s:
            continue
        under = held[w.tenant_id] < share[w.tenant_id] - 1e-9
        node, victims = _best_slot(w, real, on_slot, sharing, spoken, over, under, now_s, config)
        if node is None:
            continue
        spoken.add(node)
        held[w.tenant_id] += w.gpus
        if not victims:                       # it waits for a slot being freed already
            continue
        for r in victims:
            over[r.tenant_id] -= r.gpus
            held[r.tenant_id] -= r.gpus
        out.append(Preemption(w.id, node, tuple(sorted(r.id for r in victims))))
    return out


def _best_slot(w: Waiter, slots: Sequence[Slot], on_slot: Mapping[str, RunningJob],
               sharing: Mapping[str, list[str]], spoken: set[str], over: Mapping[str, float],
               under: bool, now_s: float,
               config: PreemptConfig) -> tuple[str | None, list[RunningJob]]:
    """For waiting job `w`, the slot to give it and the jobs to stop there: a slot being freed
    already (every job on it asked to stop) with none; else the slot whose stop needs the
    fewest victims (then the fewest GPUs). (None, []) when no slot can be had that way, or
    when one is free (admission places the job: nothing to stop)."""
    best: tuple[tuple[int, int, str], list[RunningJob]] | None = None
    for s in (s for s in slots if w.queue in s.queues and s.node not in spoken):
        blocking = [on_slot[n] for n in sharing[s.node] if n in on_slot]
        if not blocking:
            return None, []
        new = [r for r in blocking if not r.preempt_requested]
        if not new:
            return s.node, []
        if all(_may_stop(r, w, now_s, under, config) for r in new) \
                and _over_for_each(new, over):
            key = (len(new), sum(r.gpus for r in new), s.node)
            if best is None or key < best[0]:
                best = (key, new)
    return (None, []) if best is None else (best[0][2], best[1])


def _sharing(slots: Sequence[Slot]) -> dict[str, list[str]]:
    """Per slot, the slots whose jobs keep it from starting one: itself and every slot that
    pins one of its GPUs (the shared layout)."""
    by_gpu: dict[str, set[str]] = defaultdict(set)
    for s in slots:
        for g in s.gpu_ids:
            by_gpu[g].add(s.node)
    return {s.node: sorted({s.node, *(n for g in s.gpu_ids for n in by_gpu[g])})
            for s in slots}


def _may_stop(r: RunningJob, w: Waiter, now_s: float, under: bool,
              config: PreemptConfig) -> bool:
    """Whether `r` may be stopped for `w`: preemptible, another tenant's, old enough, and `w`
    either below its share or of a higher band."""
    return (r.preemptible and r.gpus > 0 and r.tenant_id != w.tenant_id
            and r.started_at is not None
            and now_s - r.started_at.timestamp() >= config.min_runtime_s
            and (under or r.priority < w.priority))


def _over_for_each(victims: Sequence[RunningJob], over: Mapping[str, float]) -> bool:
    """Whether each victim's tenant is still over its share when that victim is taken (in
    turn, largest first): a tenant at or below its share gives up nothing."""
    left = dict(over)
    for r in sorted(victims, key=lambda r: -r.gpus):
        if left.get(r.tenant_id, 0.0) <= 1e-9:
            return False
        left[r.tenant_id] -= r.gpus
    return True
