"""The isolation stage: how the attempt's child is kept apart and started, set up just before
it runs, and what of it is noted on the attempt (docs/security.md, docs/jobs.md "Limits").

Its before_run makes the child's supervisor (e31_worker.attempt.supervisor) with what the
worker has: the sandbox of the job's tenant and network (`Sandbox.for_attempt`; none with
`--isolation process`), the job cgroups (its memory and process limits), the process groups a
successor reaps, and the warm processes (`warm`, else every start is cold). The supervisor
then tells it two things, noted on the attempt together with one `AttemptStore.note_attempt`
wherever they can be (`StartNotes`):

- how it started (`isolation`, `start`: warm or cold, `start_ms`): a warm or command job's
  within its start, a cold entrypoint job's once it ended (from the time its runner noted);
- the limits the child runs under (`attempts.limits`), as soon as it started, with the
  setup's time (`setup_s`) when it was not noted yet, and with how it started when that is
  already known: one store call per attempt start instead of two (issue 31).

A store that fails only costs the note.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from e31.core.errors import StoreError
from e31.core.records import Claim
from e31.core.states import Isolation, Start
from e31.store import AttemptStore
from e31.store.attempts import AttemptFacts
from e31_worker.attempt.attemptlimits import AttemptLimits
from e31_worker.attempt.stages import Attempt, Stage
from e31_worker.attempt.supervisor import Supervisor

log = logging.getLogger(__name__)


class IsolationStage(Stage):
    """The isolation stage (module docstring): the child's supervisor, set up to run it
    sandboxed, in its cgroups and under its limits, warm or cold, behind the attempt's tick."""

    def before_run(self, attempt: Attempt) -> None:
        svc, claim = attempt.svc, attempt.claim
        notes = StartNotes(svc.repo, claim, svc.isolation)
        attempt.child = Supervisor(
            attempt.plan, tick=attempt.tick, groups=svc.groups, cgroups=svc.cgroups,
            sandbox=svc.sandbox.for_attempt(claim) if svc.sandbox else None,
            on_start=notes.started, warm=svc.warm,
            on_limits=lambda limits: notes.limits(limits, setup_s=attempt.take_setup_s()))


class StartNotes:
    """An attempt's notes at its start (module docstring). The supervisor tells how the child
    started (`started`) before the limits (`limits`, once it runs) when the start is known at
    once: that start waits for the limits' write and goes with it."""

    def __init__(self, repo: AttemptStore, claim: Claim, isolation: Isolation) -> None:
        self._repo = repo
        self._claim = claim
        self._isolation = isolation
        self._start: AttemptFacts | None = None   # how it started, until the limits' note
        self._limits_noted = False

    def started(self, start_ms: float, start: Start = Start.COLD) -> None:
        facts = AttemptFacts(isolation=self._isolation, start=start, start_ms=round(start_ms, 3))
        if self._limits_noted:
            self._note(facts, "start_note_failed")
        else:
            self._start = facts

    def limits(self, limits: AttemptLimits, *, setup_s: float | None = None) -> None:
        log.info("attempt_limits job=%s attempt=%d pids_max=%s mem_gb=%s disk_gb=%s",
                 self._claim.job_id, self._claim.attempt, limits.pids_max, limits.mem_gb,
                 limits.disk_gb)
        self._limits_noted = True
        facts = replace(self._start or AttemptFacts(), setup_s=setup_s, limits=limits.to_dict())
        self._start = None
        if not self._note(facts, "limits_note_failed") and setup_s is not None:
            # the bill then counts the setup: better than holding the job
            log.warning("setup_note_failed job=%s attempt=%d setup_s=%.2f", self._claim.job_id,
                        self._claim.attempt, setup_s)

    def _note(self, facts: AttemptFacts, failed: str) -> bool:
        """One note on the attempt; a store that fails costs the note alone (logged)."""
        try:
            self._repo.note_attempt(self._claim.job_id, self._claim.attempt, facts)
        except StoreError as exc:
            log.warning("%s job=%s attempt=%d: %s", failed, self._claim.job_id,
                        self._claim.attempt, exc)
            return False
        return True

