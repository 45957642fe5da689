"""Decayed GPU usage: how much a tenant used lately, with a half-life (SLURM, AWS Batch).

The store bills each attempt's GPU-seconds into a tenant's `UsageState` when the attempt
ends (`store/tenants.py`); fair share reads it back, decayed to now, to order tenants
(`e31.scheduling.fairshare`). Both sides use this module, so the store never imports
scheduling. Pure: every time is a float of seconds (`datetime.timestamp()`), no clock.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_HALF_LIFE_S = 7 * 86400.0   # SLURM's PriorityDecayHalfLife default: a week


@dataclass(frozen=True)
class UsageState:
    """One tenant's decayed GPU-seconds as stored: the value at `at_s` (two columns).

    Decay is lazy: the value is brought to `now_s` only when read or updated, so an update
    costs O(1) whatever the number of tenants or jobs.
    """

    value_gpu_s: float = 0.0
    at_s: float = 0.0

    def at(self, now_s: float, half_life_s: float) -> float:
        """The decayed value at `now_s` (a time before `at_s` reads as `at_s`: clock skew)."""
        return self.value_gpu_s * 2.0 ** (-max(0.0, now_s - self.at_s) / half_life_s)

    def plus(self, gpu_s: float, now_s: float, half_life_s: float) -> UsageState:
        """Add a lump of GPU-seconds at `now_s` (an attempt's bill when it ends)."""
        return UsageState(self.at(now_s, half_life_s) + gpu_s, max(now_s, self.at_s))
