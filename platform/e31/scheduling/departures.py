"""Consumers that left: the queues whose unclaimed publications may have died with a worker.

A worker takes a job's message from Redis and then claims the job in the store. One killed
between the two (alone, or with its node) takes the message with it: Celery's Redis transport
restores an unacknowledged message only after its visibility timeout, and the store still
shows the job published, not running. Without more, such a job waits `dispatch_timeout_s`
to be published again (`SchedulingStore.expire_dispatches`).

The leader reads every live heartbeat each tick. A worker whose heartbeat is gone (its key
expired: it stopped beating, or withdrew) or is written by another process under the same
name (its launcher restarted it) has left, and any message it had taken is lost. Each queue it
consumed becomes *suspect* from the moment the leader saw it leave: the publications of that
queue made before then and still unclaimed may be the lost ones, and are published again, with
new tokens, as soon as the queue has an idle consumer. A publication forgotten by mistake (its
message was still waiting in Redis, or a live worker was about to claim it) costs a message that
claims nothing (the token fences it), never a job run twice.

A suspect queue is forgotten after `window_s` (the dispatch timeout): by then the ordinary
timeout covers every publication made before the departure.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from e31.ops.heartbeat import WorkerInfo


def consumed(worker: WorkerInfo) -> tuple[str, ...]:
    """The class queues whose jobs `worker` takes: its own, those it spills to, and for a gang
    worker the class queues of its host's GPU sets."""
    return (*worker.queues, *(q for _, queues in worker.gang for q in queues))


@dataclass
class Departures:
    """What the leader saw of the workers at its last tick, and the suspect queues."""

    window_s: float
    _seen: dict[str, tuple[int, tuple[str, ...]]] = field(default_factory=dict)
    _suspect: dict[str, float] = field(default_factory=dict)   # queue -> seen to leave at (s)

    def observe(self, workers: Sequence[WorkerInfo], *, now_s: float) -> list[str]:
        """Compare `workers` (this tick's heartbeats) with the last tick's; returns the names
        of those that left, and marks their queues suspect from `now_s`."""
        current = {w.node: (w.pid, consumed(w)) for w in workers}
        left = [node for node, (pid, _) in self._seen.items()
                if node not in current or (pid and current[node][0] and current[node][0] != pid)]
        for node in left:
            for queue in self._seen[node][1]:
                self._suspect[queue] = now_s
        self._seen = current
        self._suspect = {q: at for q, at in self._suspect.items() if now_s - at < self.window_s}
        return left

    def due(self, idle_queues: Iterable[str]) -> dict[str, float]:
        """The suspect queues among `idle_queues`, each with the moment it became suspect (its
        unclaimed publications made before then are to be published again)."""
        return {q: self._suspect[q] for q in idle_queues if q in self._suspect}

    def cleared(self, queues: Iterable[str]) -> None:
        """Their suspect publications were published again: nothing is left to suspect."""
        for q in queues:
            self._suspect.pop(q, None)
