"""The isolation stage: how the attempt's child is kept apart and started, set up just before
it runs, and what of it is noted on the attempt (docs/security.md, docs/jobs.md "Limits").

Its before_run makes the child's supervisor (e31_worker.attempt.supervisor) with what the
worker has: the sandbox of the job's tenant and network (`Sandbox.for_attempt`; none with
`--isolation process`), the job cgroups (its memory and process limits), the process groups a
successor reaps, and the warm processes (`warm`, else every start is cold). The supervisor
then tells it two things, kept on the attempt's note (`e31_worker.attempt.notes`) for its next
store write, the lease's renewal a beat later or its outcome:

- how it started (`isolation`, `start`: warm or cold, `start_ms`): a warm or command job's
  within its start, a cold entrypoint job's once it ended (from the time its runner noted);
- the limits the child runs under (`attempts.limits`), as soon as it started.

Issue 31: these were one or two write transactions of their own per attempt start.
"""

from __future__ import annotations

import logging

from e31.core.states import Start
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

        def started(start_ms: float, start: Start = Start.COLD) -> None:
            attempt.note.add(AttemptFacts(isolation=svc.isolation, start=start,
                                          start_ms=round(start_ms, 3)))

        def limited(limits: AttemptLimits) -> None:
            log.info("attempt_limits job=%s attempt=%d pids_max=%s mem_gb=%s disk_gb=%s",
                     claim.job_id, claim.attempt, limits.pids_max, limits.mem_gb,
                     limits.disk_gb)
            attempt.note.add(AttemptFacts(limits=limits.to_dict()))

        attempt.child = Supervisor(
            attempt.plan, tick=attempt.tick, groups=svc.groups, cgroups=svc.cgroups,
            sandbox=svc.sandbox.for_attempt(claim) if svc.sandbox else None,
            on_start=started, warm=svc.warm, spawner=svc.spawner,
            on_limits=limited)
