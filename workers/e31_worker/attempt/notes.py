"""An attempt's notes on its own row (how it started, the limits it runs under, its setup's time,
its GPU use), kept until the attempt's next store write carries them.

A worker learns these as the attempt goes: the setup's time when the setup ends, how the child
started and its limits as it starts, its GPU use once it ended. Each was a write transaction of
its own (`AttemptStore.note_attempt`); now they wait in the attempt's `PendingNote` and go with
the next write the attempt makes anyway, in that write's transaction (issue 31): the lease's
renewal at the next beat (`LeaseKeeper`, every `heartbeat_interval_s`) or the outcome
(`finish_attempt`). A job that ends within its first beat makes three transactions (claim,
outcome, and nothing between) where it made four.

What it costs: a running attempt's start and limits show in its status from its first
renewal, a beat after its start, rather than at once; a worker that dies before its next
write (within that beat, or while it holds an ended attempt for the artifact store, whose
renewals carry nothing) takes them with it, and the attempt's bill then counts its setup
(docs/jobs.md). A renewal that fails puts the facts back for the next write.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import fields, replace

from e31.core.errors import StoreError
from e31.store.attempts import AttemptFacts, AttemptNote

log = logging.getLogger(__name__)


class PendingNote:
    """The facts of attempt `n` not written yet; `add` from any thread, `take` for a write."""

    def __init__(self, job_id: str, n: int) -> None:
        self._job_id, self._n = job_id, n
        self._lock = threading.Lock()
        self._facts = AttemptFacts()

    def add(self, facts: AttemptFacts) -> None:
        """Keep `facts` for the next write (a field set again replaces the one kept); facts
        the store would refuse (a negative figure) are dropped here, logged, so that they
        never cost the write that carries them."""
        try:
            facts.values()
        except StoreError as exc:
            log.warning("attempt_note_dropped job=%s attempt=%d: %s", self._job_id, self._n, exc)
            return
        with self._lock:
            self._facts = _over(self._facts, facts)

    def take(self) -> AttemptNote | None:
        """What is kept, for one write (None: nothing); `put_back` if that write failed."""
        with self._lock:
            facts, self._facts = self._facts, AttemptFacts()
        return AttemptNote(self._n, facts) if facts.values() else None

    def put_back(self, note: AttemptNote | None) -> None:
        """A taken note whose write failed: kept again, under what was added since."""
        if note is not None:
            with self._lock:
                self._facts = _over(note.facts, self._facts)


def _over(base: AttemptFacts, newer: AttemptFacts) -> AttemptFacts:
    """`base` with every field that `newer` sets set as `newer` has it."""
    return replace(base, **{f.name: getattr(newer, f.name) for f in fields(newer)
                            if getattr(newer, f.name) is not None})
