"""The isolation stage: how the attempt's child is kept apart and started, set up just before
it runs, and what of it is noted on the attempt (docs/security.md, docs/jobs.md "Limits").

Its before_run makes the child's supervisor (e31_worker.attempt.supervisor) with what the
worker has: the sandbox of the job's tenant and network (`Sandbox.for_attempt`; none with
`--isolation process`), the job cgroups (its memory and process limits), the process groups a
successor reaps, and the warm processes (`warm`, else every start is cold). The supervisor
then tells it two things, each noted on the attempt with one `AttemptStore.note_attempt`:

- the limits the child runs under, before it starts (`attempts.limits`), with the setup's
  time (`setup_s`) in the same write when it was not noted yet: one store call before the
  job runs instead of two;
- how it started (`isolation`, `start`: warm or cold, `start_ms`).

A store that fails only costs the note.
"""

from __future__ import annotations

import logging

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
        attempt.child = Supervisor(
            attempt.plan, tick=attempt.tick, groups=svc.groups, cgroups=svc.cgroups,
            sandbox=svc.sandbox.for_attempt(claim) if svc.sandbox else None,
            on_start=lambda ms, start: note_start(svc.repo, claim, svc.isolation, ms, start),
            warm=svc.warm,
            on_limits=lambda limits: note_limits(svc.repo, claim, limits,
                                                 setup_s=attempt.take_setup_s()))


def note_limits(repo: AttemptStore, claim: Claim, limits: AttemptLimits, *,
                setup_s: float | None = None) -> None:
    """Note the limits the attempt runs under on it (`attempts.limits`), before it starts,
    and its setup's time (`setup_s`) when given, in the same write."""
    log.info("attempt_limits job=%s attempt=%d pids_max=%s mem_gb=%s disk_gb=%s",
             claim.job_id, claim.attempt, limits.pids_max, limits.mem_gb, limits.disk_gb)
    try:
        repo.note_attempt(claim.job_id, claim.attempt,
                          AttemptFacts(setup_s=setup_s, limits=limits.to_dict()))
    except StoreError as exc:  # the bill then counts the setup: better than holding the job
        if setup_s is not None:
            log.warning("setup_note_failed job=%s attempt=%d setup_s=%.2f: %s", claim.job_id,
                        claim.attempt, setup_s, exc)
        log.warning("limits_note_failed job=%s attempt=%d: %s", claim.job_id, claim.attempt,
                    exc)


def note_start(repo: AttemptStore, claim: Claim, isolation: Isolation, start_ms: float,
               start: Start = Start.COLD) -> None:
    """Note how the attempt's child started (`warm`: forked from the worker's warm process)
    and how long from the attempt's start to its first line of code."""
    try:
        repo.note_attempt(claim.job_id, claim.attempt, AttemptFacts(
            isolation=isolation, start=start, start_ms=round(start_ms, 3)))
    except StoreError as exc:
        log.warning("start_note_failed job=%s attempt=%d: %s", claim.job_id, claim.attempt, exc)
