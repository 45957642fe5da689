"""Admission policy: how many jobs each queue may publish now, and in what order.

This is the scheduler's policy hook. The default admits by priority, then age (the order
`Repo.dispatch_candidates` returns); fair share between tenants replaces `order`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from e31.store.records import Candidate


@dataclass(frozen=True)
class WorkerInfo:
    """One worker node as its heartbeat describes it; `queues[0]` is its own class."""

    node: str
    queues: tuple[str, ...]
    gpus: str
    busy_job: str | None = None


def idle_workers(workers: Sequence[WorkerInfo], busy_nodes: set[str]) -> list[WorkerInfo]:
    """Workers free for a job: their heartbeat says so and they hold no live lease."""
    return [w for w in workers if w.busy_job is None and w.node not in busy_nodes]


def plan(workers: Sequence[WorkerInfo], busy_nodes: set[str], demand: Mapping[str, int],
         outstanding: Mapping[str, int], *, headroom: int,
         rank: Callable[[str], int]) -> dict[str, int]:
    """Messages to publish per queue: the idle slots that can take it, plus `headroom`.

    Queues are served from the biggest class down (`rank`, lower first), and each idle
    worker counts once, for its own class before the smaller ones it spills to, so a
    gpu80 worker is not promised to gpu24 work while gpu80 work waits. Messages already
    published and not yet claimed (`outstanding`) use up slots. Headroom is only given to
    queues that have at least one live consumer, so a class without workers gets none.
    """
    idle = idle_workers(workers, busy_nodes)
    assigned: set[str] = set()
    result: dict[str, int] = {}
    for queue in sorted(demand, key=rank):
        if demand[queue] <= 0:
            continue
        consumers = [w for w in workers if queue in w.queues]
        eligible = sorted((w for w in idle if queue in w.queues and w.node not in assigned),
                          key=lambda w: w.queues.index(queue))
        pending = outstanding.get(queue, 0)
        take = eligible[: demand[queue] + pending]
        assigned.update(w.node for w in take)
        slots = len(take) + (headroom if consumers else 0) - pending
        result[queue] = max(0, min(demand[queue], slots))
    return result


def order(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Priority band first, then submission time (the store already returns this order)."""
    return sorted(candidates, key=lambda c: (-c.priority, c.submitted_at, c.id))
