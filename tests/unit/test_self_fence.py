"""A worker cut off from the store and Redis both stops its job on the silence after which the
scheduler takes it for gone (docs/reliability.md, "A dead node noticed in seconds"), not a whole
lease later: two copies of the job must not run on side by side."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from e31.core.errors import StoreUnavailable
from e31.ops.heartbeat import silence_s
from e31.store.attempts import AttemptFacts
from e31_worker.attempt import watchdog
from e31_worker.attempt.notes import PendingNote
from e31_worker.attempt.plan import Directive

INTERVAL_S = 2.0        # the pool's default heartbeat interval: a silence of 3 s
LEASE_TTL_S = 10.0


def unreachable_store(*_: object, **__: object) -> None:
    raise StoreUnavailable("results store unavailable: connection refused")


def keeper(*, unheard_s: float, unrenewed_s: float,
           note: PendingNote | None = None) -> watchdog.LeaseKeeper:
    """A lease keeper whose store cannot be reached, last renewed `unrenewed_s` ago, in a
    worker whose heartbeat last reached Redis `unheard_s` ago; `note`: its attempt's."""
    beat_at = time.monotonic() - unheard_s
    svc = SimpleNamespace(repo=SimpleNamespace(renew=unreachable_store),
                          settings=SimpleNamespace(lease_ttl_s=LEASE_TTL_S,
                                                   heartbeat_interval_s=INTERVAL_S),
                          draining=threading.Event(), last_beat=lambda: beat_at)
    k = watchdog.LeaseKeeper(svc, SimpleNamespace(job_id="j1", token=1, attempt=1),  # type: ignore[arg-type]
                             SimpleNamespace(poke=lambda: None),  # type: ignore[arg-type]
                             note or PendingNote("j1", 1))
    k._renewed = time.monotonic() - unrenewed_s
    return k


def test_a_worker_unheard_and_unrenewed_past_the_silence_stops_its_job() -> None:
    # Given a worker whose store and Redis have both been out of reach for longer than the
    # silence (3 s), well within its lease
    silent = silence_s(INTERVAL_S) + 0.5
    assert silent < LEASE_TTL_S

    # When its supervisor ticks
    directive = keeper(unheard_s=silent, unrenewed_s=silent)(None)

    # Then it stops its job as lost, as the scheduler takes it
    assert directive is Directive.LOST


def test_a_worker_that_still_beats_keeps_its_job_to_its_lease() -> None:
    # Given the same worker, whose heartbeat still reaches Redis (only its store is slow): the
    # scheduler does not judge it, so neither does it
    silent = silence_s(INTERVAL_S) + 0.5

    # When its supervisor ticks, then the job goes on; and once its lease is over, it stops
    assert keeper(unheard_s=0.0, unrenewed_s=silent)(None) is Directive.CONTINUE
    assert keeper(unheard_s=0.0, unrenewed_s=LEASE_TTL_S + 0.5)(None) is Directive.LOST


def test_a_worker_that_renewed_lately_keeps_its_job_whatever_redis_says() -> None:
    # Given a worker whose Redis is gone but whose last renewal is within the silence
    # When its supervisor ticks (this renewal fails), then the job goes on
    assert keeper(unheard_s=60.0, unrenewed_s=1.0)(None) is Directive.CONTINUE


def test_a_renewal_that_fails_keeps_the_attempts_note_for_the_next_write() -> None:
    # Given an attempt that noted its limits, and a store that cannot be reached
    note = PendingNote("j1", 1)
    note.add(AttemptFacts(limits={"pids_max": 64}, setup_s=1.0))

    # When its supervisor ticks (the renewal that would carry the note fails)
    keeper(unheard_s=0.0, unrenewed_s=1.0, note=note)(None)

    # Then the note waits for the next renewal or the outcome
    kept = note.take()
    assert kept is not None and kept.facts == AttemptFacts(limits={"pids_max": 64}, setup_s=1.0)
