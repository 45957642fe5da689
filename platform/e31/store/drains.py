"""Drain requests, kept in the store: an operator's (`e31 worker --drain`), or a node's own
when one of its GPUs reported an XID error (with the reason, shown by `e31 queue`).

The worker node watches a Redis key (`e31.core.keys.drain`) at each heartbeat, but anyone who
holds the broker's URL can write one; the key only rings the bell. The node drains only if
the store, which no job and no broker client can write, holds a request for it
(docs/security.md, "The broker is not a trust boundary").

`DrainStore` keeps them. Who uses it: the worker node (its drain check at each heartbeat, its
own request on a GPU fault) and its launcher (which nodes stay stopped, whose requests to
forget), both through `AttemptStore`; `e31 worker --drain` and `e31 queue` (the CLI and the
API).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, select

from e31.core.states import JobState
from e31.store.base import Store
from e31.store.models import DrainRequest, Job


@dataclass(frozen=True)
class DrainedNode:
    """A node out of service: since when, and why (None: an operator asked)."""

    node: str
    requested_at: datetime
    reason: str | None

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "since": self.requested_at.isoformat(),
                "reason": self.reason or "drained by an operator"}


class DrainStore(Store):
    """Nodes' drain requests."""

    def request_drain(self, nodes: Sequence[str], *, now: datetime,
                      reason: str | None = None) -> None:
        """Record that `nodes` are to drain (a newer request replaces one): asked by an
        operator (no `reason`), or by a node itself, saying why (a GPU's XID error)."""
        names = list(dict.fromkeys(nodes))
        if not names:
            return
        with self._session(write=True) as s:
            s.execute(delete(DrainRequest).where(DrainRequest.node.in_(names)))
            s.add_all(DrainRequest(node=n, requested_at=now, reason=reason) for n in names)

    def drained_nodes(self) -> list[DrainedNode]:
        """Every node asked to drain and not started again since, oldest request first: what
        `e31 queue` shows as out of service, with the reason."""
        with self._session() as s:
            rows = s.execute(select(DrainRequest.node, DrainRequest.requested_at,
                                    DrainRequest.reason).order_by(DrainRequest.requested_at,
                                                                  DrainRequest.node))
            return [DrainedNode(node, at, reason) for node, at, reason in rows]

    def drain_requested(self, node: str, *, since: datetime) -> bool:
        """Whether an operator asked `node` to drain at `since` or later."""
        with self._session() as s:
            return s.scalar(select(DrainRequest.node).where(
                DrainRequest.node == node, DrainRequest.requested_at >= since)) is not None

    def clear_drain(self, nodes: Sequence[str]) -> int:
        """Forget the drain requests of `nodes` (their launcher starts them again)."""
        if not nodes:
            return 0
        with self._session(write=True) as s:
            res = s.execute(delete(DrainRequest).where(DrainRequest.node.in_(list(nodes))))
            return int(res.rowcount or 0)  # type: ignore[attr-defined]

    def drained_since(self, *, since: datetime) -> set[str]:
        """The nodes with a drain request made at `since` or later (an operator's or a node's
        own): what a launcher that keeps drains (`e31 up`) leaves stopped."""
        with self._session() as s:
            return set(s.scalars(select(DrainRequest.node).where(
                DrainRequest.requested_at >= since)))

    def jobs_running_on(self, nodes: Sequence[str]) -> list[str]:
        """The ids of the `running` jobs whose lease one of `nodes` holds: a drain is done only
        when none is left (each was recorded `drained` and queued again, or recovered)."""
        if not nodes:
            return []
        with self._session() as s:
            return list(s.scalars(select(Job.id).where(
                Job.state == JobState.RUNNING.value, Job.lease_owner.in_(list(nodes)),
            ).order_by(Job.id)))
