"""`LeaseKeeper`: the supervisor's tick while an attempt runs — the lease, progress, and
the stop signals (cancel, drain, preemption, a lost lease)."""

from __future__ import annotations

import logging
import time

from e31.core.clock import utcnow
from e31.core.records import Claim
from e31_worker.attempt.services import AttemptServices
from e31_worker.attempt.shipping import Shipper
from e31_worker.attempt.supervisor import Directive

log = logging.getLogger(__name__)


class LeaseKeeper:
    """The supervisor's tick: renews the lease each beat, relays progress, log and checkpoints,
    and watches for cancel, drain and preemption.

    A worker that cannot renew for a whole TTL (its store or its network is gone) stops
    its job as `lost` on its own: by then the scheduler may have started the job elsewhere,
    and two copies must not run on for longer than that.
    """

    def __init__(self, svc: AttemptServices, claim: Claim, shipper: Shipper) -> None:
        self._svc, self._claim, self._shipper = svc, claim, shipper
        self._renewed = time.monotonic()

    def __call__(self, progress: tuple[float, float] | None) -> Directive:
        svc, claim = self._svc, self._claim
        try:
            renewal = svc.repo.renew(claim.job_id, claim.token, now=utcnow(),
                                     lease_ttl_s=svc.settings.lease_ttl_s, progress=progress)
        except Exception as exc:  # noqa: BLE001 - keep the job running while the lease lasts
            silent_s = time.monotonic() - self._renewed
            log.warning("lease_renew_failed job=%s silent_s=%.1f: %s: %s", claim.job_id, silent_s,
                        type(exc).__name__, exc)
            if silent_s > svc.settings.lease_ttl_s:
                log.error("lease_expired_locally job=%s attempt=%d: no renewal for %.1f s; "
                          "stopping the job (it is recovered elsewhere)", claim.job_id,
                          claim.attempt, silent_s)
                return Directive.LOST
            return Directive.DRAIN if svc.draining.is_set() else Directive.CONTINUE
        if not renewal.ours:
            return Directive.LOST
        self._renewed = time.monotonic()
        self._shipper.poke()
        if renewal.cancel:
            return Directive.CANCEL
        if svc.draining.is_set():
            return Directive.DRAIN
        if renewal.preempt:
            return Directive.PREEMPT
        return Directive.CONTINUE
