"""Limits per tenant: what one team may ask of the shared pool (docs/configuration.md).

The pool's defaults are settings (`tenant_max_priority` …); a tenant's own overrides are the
`tenants.limits` JSON column, keyed by the names in `LIMIT_KEYS`. An admin writes them through
the admin API, which validates them with `check_limits` first; `TenantLimits.of` combines
both into the limits a request is held to. The API enforces them at submit
(`e31.api.services.submission`): a priority or an array over its limit is refused 422, a body
over its limit 413, and a tenant at its most queued jobs or past its submit rate 429 with
`Retry-After`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from e31.core.errors import SpecError

MAX_PRIORITY = 9                  # the spec's own bound (`JobSpec.priority`)
MAX_QUEUED_CAP = 100_000_000      # a typo guard, far above any pool's backlog
MAX_ARRAY_ITEMS_CAP = 10_000      # an array's own bound (`e31.ops.sweep.MAX_ARRAY_ITEMS`)
MAX_REQUEST_BYTES_CAP = 1 << 40   # a typo guard; the pool's `max_request_bytes` bounds every
#                                   body anyway, so an override above it changes nothing
MAX_RATE_PER_S = 1_000_000.0      # a typo guard


@dataclass(frozen=True)
class TenantLimits:
    """The limits one tenant's requests are held to: the pool's defaults under its overrides.

    `max_queued` counts the tenant's queued jobs (arrays' items included); `submit_rate_per_s`
    and `submit_burst` are a token bucket of submit requests (a job, an array, a dry run not:
    it stores nothing), shared by every API process through Redis."""

    max_priority: int
    max_queued: int
    max_array_items: int
    max_request_bytes: int
    submit_rate_per_s: float
    submit_burst: int

    @classmethod
    def of(cls, defaults: TenantLimits, overrides: Mapping[str, Any] | None) -> TenantLimits:
        """`defaults` with a tenant's `overrides` (`tenants.limits`) over them. A key the
        admin API never wrote (a hand-edited row) is ignored rather than trusted."""
        try:
            given = check_limits(overrides or {})
        except SpecError:
            given = {}
        return cls(**{**{f.name: getattr(defaults, f.name) for f in fields(cls)}, **given})

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


LIMIT_KEYS = tuple(f.name for f in fields(TenantLimits))
"""The keys of `tenants.limits` (and of the admin API's `limits`)."""


def _whole(key: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise SpecError.one(f"limits.{key}", f"must be a whole number from {low} to {high}")
    return value


def check_limits(limits: Mapping[str, Any]) -> dict[str, Any]:
    """Validate a tenant's limit overrides (for the admin API, before it stores them in
    `tenants.limits`): the known keys only (`LIMIT_KEYS`), each a number in its range.
    Returns them normalised (`2.0` as 2 where a whole number is meant); raises `SpecError`
    naming `limits.<key>` and why. A value of None means "the pool's default": such keys are
    dropped from the result, so storing the result removes the override."""
    if not isinstance(limits, Mapping):
        raise SpecError.one("limits", "must be a mapping of limit names to numbers")
    out: dict[str, Any] = {}
    for key, value in limits.items():
        if key not in LIMIT_KEYS:
            raise SpecError.one(f"limits.{key}", f"unknown limit; known: {', '.join(LIMIT_KEYS)}")
        if value is None:
            continue
        if key == "max_priority":
            out[key] = _whole(key, value, 0, MAX_PRIORITY)
        elif key == "max_queued":
            out[key] = _whole(key, value, 0, MAX_QUEUED_CAP)
        elif key == "max_array_items":
            out[key] = _whole(key, value, 1, MAX_ARRAY_ITEMS_CAP)
        elif key == "max_request_bytes":
            out[key] = _whole(key, value, 1024, MAX_REQUEST_BYTES_CAP)
        elif key == "submit_burst":
            out[key] = _whole(key, value, 1, int(MAX_RATE_PER_S))
        else:
            if isinstance(value, bool) or not isinstance(value, int | float) \
                    or not math.isfinite(value) or not 0 < value <= MAX_RATE_PER_S:
                raise SpecError.one(f"limits.{key}", "must be a number of requests per second "
                                                     f"above 0, at most {MAX_RATE_PER_S:g}")
            out[key] = float(value)
    return out
