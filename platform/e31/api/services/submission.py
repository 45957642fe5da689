"""The steps of a submission, in the order every submission takes them:

1. **limits**: the tenant's submit rate and body size (`tenant_limits`), then the caps on one
   job and the tenant's highest priority (`within_limits`);
2. **bundles**: the bundles and inputs the spec names, and its requirements file
   (`check_bundles`); a single job's `array:` inputs after its secrets (`check_array_inputs`);
3. **secrets**: each secret it names is one the tenant has set (`check_secrets`);
4. **placement**: the pool's retry defaults, its size class and queue, and a registered node
   that can hold it (`place`);
5. **insert**: one transaction (`inserting` turns the store's refusal into a 409), then the
   scheduler is woken (`wake`).

The caps on one request's jobs together (`tally`) count a job as it passes: a single job right
after its limits, a fan-out's chunk after its secrets, an array's item after its placement.
A job (`JobService.submit`), an array's items (`ArrayService.submit`) and a footage fan-out's
chunks (`FanoutService`) take these steps; a dry run takes them without the insert. The first
refusal answers (limits 413/429/422, a forbidden input 403, a missing bundle 409, a bad
requirements line 422, a missing secret 409, no class or node 422): the order is part of the
answers, so the services call the steps in this order and no other. Bundles come before
secrets: a spec that names both a bundle and a secret its tenant lacks is answered for the
bundle, as it always was.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import redis

from e31.api.requestlimits import SubmitRate, spec_limits
from e31.api.services.bundles import BundleService
from e31.api.services.readings import PoolReadings
from e31.api.services.requirements import Memo, RequirementsCheck
from e31.core.bundles import ARRAY_INPUT, parse_array_input
from e31.core.errors import NotFound, SpecConflict, SpecError, TooLarge
from e31.core.records import TenantRecord
from e31.core.requestlimits import RequestTally
from e31.core.sizeclasses import Route, route
from e31.core.spec import JobSpec
from e31.core.tenantlimits import TenantLimits
from e31.edge.settings import Settings
from e31.ops.heartbeat import wake
from e31.scheduling import placement
from e31.store import Repo

log = logging.getLogger(__name__)


class Submission:
    """The steps above, over one store, Redis, bundle store and view of the pool."""

    def __init__(self, *, settings: Settings, repo: Repo, redis_client: redis.Redis,
                 bundles: BundleService, requirements: RequirementsCheck,
                 readings: PoolReadings) -> None:
        self._settings = settings
        self._repo = repo
        self._redis = redis_client
        self._bundles = bundles
        self._requirements = requirements   # python.requirements, line by line
        self._readings = readings
        self._caps = spec_limits(settings)
        self._rate = SubmitRate(redis_client)

    # 1. limits

    def tenant_limits(self, tenant: TenantRecord, *, body_bytes: int,
                      rate: bool) -> TenantLimits:
        """The tenant's limits (the pool's defaults under its own); refuses a body over its
        `max_request_bytes` (413) and, with `rate`, a submit past its rate (429)."""
        limits = TenantLimits.of(self._settings.tenant_limits, tenant.limits)
        if rate:
            self._rate.take(tenant.id, tenant.name, limits)
        if body_bytes > limits.max_request_bytes:
            raise TooLarge(f"the request body is larger than {limits.max_request_bytes} bytes, "
                           f"the most for tenant {tenant.name} (limits.max_request_bytes)",
                           limit_bytes=limits.max_request_bytes)
        return limits

    def within_limits(self, spec: JobSpec, tenant: TenantRecord,
                      limits: TenantLimits) -> JobSpec:
        """`spec`, or `SpecError` naming each cap on one job that it passes (`max_env_vars` …)
        and the tenant's highest priority (`limits.max_priority`)."""
        errors = self._caps.check(spec)
        if spec.priority > limits.max_priority:
            errors.append({"field": "priority", "reason": (
                f"at most {limits.max_priority} for tenant {tenant.name} "
                "(limits.max_priority); ask an admin")})
        if errors:
            raise SpecError(errors)
        return spec

    def tally(self, *, field: str | None = None) -> RequestTally:
        """The running totals of one request's jobs (`RequestTally`), against the pool's caps;
        a refusal names `field` (an array's `items`), else the job's own field."""
        return RequestTally(self._caps, field=field)

    # 2. bundles

    def check_bundles(self, tenant: TenantRecord, spec: JobSpec, *, memo: Memo | None = None,
                      dry_run: bool = False) -> list[str]:
        """The bundles and inputs `spec` names (`BundleService.check_spec`: 403 for an input
        no tenant may read, 409 for a bundle the tenant has not uploaded, unless `dry_run`,
        which returns the fields that name one), then its requirements file (422 naming
        `python.requirements`). `memo`: what one request already read of a bundle's file."""
        missing = self._bundles.check_spec(tenant.id, spec, dry_run=dry_run)
        self._requirements.check(tenant.id, spec, memo=memo)
        return missing

    def check_array_inputs(self, tenant: TenantRecord, spec: JobSpec) -> None:
        """An `array:<id>/outputs` input names an array of the tenant (409 otherwise)."""
        for name, source in spec.inputs.items():
            if ARRAY_INPUT.fullmatch(source):
                try:
                    self._repo.get_array(tenant.id, parse_array_input(source), items=False)
                except NotFound:
                    raise SpecConflict.one(f"inputs.{name}", "names no array of this "
                                                             "tenant") from None

    # 3. secrets

    def check_secrets(self, tenant: TenantRecord, spec: JobSpec) -> None:
        """`SpecConflict` (409) naming each secret of `spec` that the tenant has not set (as a
        bundle or dependency it lacks): another tenant's of the same name does not count."""
        missing = self.missing_secrets(tenant, spec)
        if missing:
            raise SpecConflict([{"field": f"secrets[{spec.secrets.index(n)}]", "reason": (
                f"{n}: tenant {tenant.name} has no secret of that name (e31 secret set {n})")}
                for n in missing])

    def missing_secrets(self, tenant: TenantRecord, spec: JobSpec) -> list[str]:
        """The secrets of `spec` that the tenant has not set (what a dry run lists)."""
        return self._repo.missing_secrets(tenant.id, spec.secrets)

    # 4. placement

    def nodes(self) -> placement.Shapes | None:
        """The registered node shapes that `place` holds a job to (None: not known)."""
        return self._readings.nodes()

    def place(self, spec: JobSpec,
              nodes: placement.Shapes | None = None) -> tuple[JobSpec, Route]:
        """The spec as this pool runs it (the pool's `[retries]` under the spec's own) and its
        size class and queue; `SpecError` naming the field when no class takes it, or when no
        registered node (`nodes`, `placement.shapes`) has the GPUs it asks for and the spec
        does not say `allow_pending`."""
        spec = spec.with_retry_defaults(self._settings.retries)
        where = route(spec, self._settings.size_classes)
        if not spec.allow_pending and (
                why := placement.missing(where.size_class, where.gpus, nodes or {})):
            raise SpecError.one("resources.gpus", f"{why}; set allow_pending "
                                                  "(e31 submit --allow-pending) to hold the "
                                                  "job until such a node joins")
        return spec, where

    # 5. insert

    @staticmethod
    @contextlib.contextmanager
    def inserting() -> Iterator[None]:
        """Around the store's insert: it refuses a valid spec only for its dependencies (one
        the tenant lacks, one that failed), a conflict with what it holds (409), not an
        invalid request."""
        try:
            yield
        except SpecError as exc:
            raise SpecConflict(exc.errors) from None

    def wake(self, what: str) -> None:
        """Wake the scheduler for what was just stored (`what` names it in the log)."""
        try:
            wake(self._redis)
        except redis.RedisError as exc:  # the work is stored; the next tick publishes it
            log.warning("scheduler_wake_failed for=%s: %s", what, exc)
