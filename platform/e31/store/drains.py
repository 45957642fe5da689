"""Operators' drain requests (`e31 worker --drain`), kept in the store.

The worker node watches a Redis key (`e31.keys.drain`) at each heartbeat, but anyone who
holds the broker's URL can write one; the key only rings the bell. The node drains only if
the store, which no job and no broker client can write, holds a request for it
(docs/security.md, "The broker is not a trust boundary"). A mixin of `Repo` (which
supplies `_session`), so there is one repository to pass around.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from datetime import datetime

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from e31.store.models import DrainRequest


class DrainQueries:
    """The drain requests' part of `Repo`."""

    def _session(self, *, write: bool = False) -> AbstractContextManager[Session]:
        raise NotImplementedError

    def request_drain(self, nodes: Sequence[str], *, now: datetime) -> None:
        """Record that an operator asked `nodes` to drain (a newer request replaces one)."""
        names = list(dict.fromkeys(nodes))
        if not names:
            return
        with self._session(write=True) as s:
            s.execute(delete(DrainRequest).where(DrainRequest.node.in_(names)))
            s.add_all(DrainRequest(node=n, requested_at=now) for n in names)

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
