"""The attempt as stages: `Stage`, whose method names list every stage of an attempt in the
order they run, and `Attempt`, the one object the stages of an attempt share.

In the spirit of Dramatiq's `Middleware`, whose method names list every stage of a message,
the task (`e31_worker.attempt.task`) runs a claimed attempt as a loop over its stages:

    claim → setup, each stage in order (timed together: the attempt's `setup_s`)
          → before_run, each stage in order → the child (its `Supervisor`)
          → after_run, each stage in order → record (ship its files, write its outcome)
          → on_end, each stage in order

A stage implements the hooks it needs; the others do nothing. The worker's stages, in order,
each in its own module:

    stage        module        what it does
    workspace    workspace     setup: the attempt's directories and claim file; on_end: removed
    secrets      secrets       setup: the job's secrets, decrypted into its plan
    code         bundle        setup: its code bundle, unpacked read-only
    inputs       inputs        setup: its inputs, staged into $E31_INPUT_DIR
    environment  environment   setup: its own Python environment, built or from the cache
    shipping     shipping      setup: the checkpoints of its earlier attempts, restored
    watchdog     watchdog      before_run: the idle watch behind the lease; after_run: GPU use
    isolation    isolation     before_run: the child's sandbox, cgroups, limits, warm or cold

A setup that fails (`SetupError`, the user's: reason `setup`; `SetupTransient`, a fault of
ours that may pass: reason `setup_transient`, retried on the pool's account; `SetupStopped`:
cancelled, drained or lost while it ran) skips the run: no stage's before_run or after_run is
called, and the record and every on_end are. Any other error of a hook up to after_run becomes the
attempt's outcome (reason `worker_crashed`, the pool's) and the worker goes on serving.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from e31.core.records import Claim, Outcome
from e31_worker.attempt.notes import PendingNote
from e31_worker.attempt.plan import AttemptPlan, Tick
from e31_worker.attempt.services import AttemptServices

if TYPE_CHECKING:   # the shipping stage's module defines the shipper, and imports this one
    from e31_worker.attempt.shipping import Shipper
    from e31_worker.attempt.supervisor import Supervisor


@dataclass
class Attempt:
    """One claimed attempt, as its stages share it: what they read, and what they add."""

    svc: AttemptServices       # the worker process's settings, identity and connections
    claim: Claim               # the job's spec, tenant, attempt number and fencing token
    plan: AttemptPlan          # how its child runs; the setup's stages add to it
    shipper: Shipper           # its log, checkpoints and outputs to the artifact store
    lease: Tick                # the lease keeper: renews the lease, says when to stop
    # What the child's supervisor calls every beat: the lease, and behind it the watchdog
    # once its stage set it up (before_run).
    tick: Tick
    # What it learns of itself (its setup's time, start, limits, GPU use), until its next
    # store write carries it (e31_worker.attempt.notes)
    note: PendingNote
    # What the setup holds for the attempt (its environment, against eviction): released
    # once the child ended, before the record.
    held: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    child: Supervisor | None = None   # the run, made by the isolation stage (before_run)


class Stage:
    """One stage of an attempt. Every hook does nothing unless a stage overrides it; the
    hooks are listed in the order they run."""

    def setup(self, attempt: Attempt) -> None:
        """Prepare what the child needs, before it starts; every stage's setup runs in order,
        and their time together is the attempt's `setup_s` (noted, never billed). It may add
        to `attempt.plan`, hold what the attempt needs until the child ended on
        `attempt.held`, and beat the lease while it waits (`watchdog.lease_beat`). It raises
        `SetupError` for the user's fault (the attempt ends with reason `setup`, no retry),
        `SetupTransient` for a fault of ours that may pass (`setup_transient`, retried on
        the pool's account); `SetupStopped` when the lease says stop; anything else is the
        worker's error (`worker_crashed`, the pool's)."""

    def before_run(self, attempt: Attempt) -> None:
        """Once every setup succeeded and the setup's time is measured, just before the child
        starts: set up what watches it (`attempt.tick`) and what runs it (`attempt.child`)."""

    def after_run(self, attempt: Attempt, outcome: Outcome) -> None:
        """Once the child ended with `outcome` (not after a failed setup), before what the
        setup held is released and before the record: note what was measured while it ran."""

    def on_end(self, attempt: Attempt, outcome: Outcome) -> None:
        """Last, always, once the outcome was offered to the store (recorded, or refused by
        the fence) or the record failed: clean up what the attempt leaves on the host."""
