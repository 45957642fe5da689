"""The workspace stage: the attempt's directory on the worker's host,
`<work_dir>/<job>/attempt-<n>`, with the job's `work`, `output` and `checkpoints` in it.

It is made first, with the claim beside it (`claim.json`: what a restarted worker needs to
record an outcome its predecessor could not, e31_worker.attempt.settle), and removed last,
once the outcome was offered to the store, read-only bundle and all.
"""

from __future__ import annotations

from e31.core.records import Outcome
from e31_worker.attempt.code import remove_tree
from e31_worker.attempt.record import write_claim
from e31_worker.attempt.stages import Attempt, Stage


class WorkspaceStage(Stage):
    """The workspace stage (module docstring)."""

    def setup(self, attempt: Attempt) -> None:
        attempt.plan.make_dirs()
        write_claim(attempt.plan.root, attempt.svc.identity.node, attempt.claim)

    def on_end(self, attempt: Attempt, outcome: Outcome) -> None:
        remove_tree(attempt.plan.root)   # an unpacked bundle is read-only
