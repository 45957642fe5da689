"""An attempt's pending note (`e31_worker.attempt.notes`): what it learns of itself waits for
its next store write, and a write that fails gives it back without losing what came since."""

from __future__ import annotations

from e31.core.states import Isolation, Start
from e31.store.attempts import AttemptFacts
from e31_worker.attempt.notes import PendingNote


def test_facts_added_apart_are_taken_as_one_note_once() -> None:
    note = PendingNote("j-0", 2)
    note.add(AttemptFacts(setup_s=1.5))
    note.add(AttemptFacts(isolation=Isolation.SANDBOX, start=Start.WARM, start_ms=9.0))
    note.add(AttemptFacts(limits={"pids_max": 64}))

    taken = note.take()

    assert taken is not None and taken.n == 2
    assert taken.facts == AttemptFacts(isolation=Isolation.SANDBOX, start=Start.WARM,
                                       start_ms=9.0, setup_s=1.5, limits={"pids_max": 64})
    assert note.take() is None   # nothing is written twice


def test_a_note_whose_write_failed_comes_back_under_what_was_added_since() -> None:
    note = PendingNote("j-0", 1)
    note.add(AttemptFacts(setup_s=1.0, start_ms=5.0))
    failed = note.take()
    note.add(AttemptFacts(start_ms=7.0, gpu_util_mean=50.0))   # learnt while the write failed

    note.put_back(failed)

    again = note.take()
    assert again is not None
    assert again.facts == AttemptFacts(setup_s=1.0, start_ms=7.0, gpu_util_mean=50.0)


def test_a_fact_the_store_would_refuse_is_dropped_and_costs_nothing_else() -> None:
    note = PendingNote("j-0", 1)
    note.add(AttemptFacts(setup_s=2.0))
    note.add(AttemptFacts(start_ms=-1.0))   # a clock that went back

    taken = note.take()

    assert taken is not None and taken.facts == AttemptFacts(setup_s=2.0)
