"""`RetryPolicy`: how often a failed attempt is retried, and how long the job waits first."""

from __future__ import annotations

from pydantic import Field

from e31.core.strict import Strict, Whole


class RetryPolicy(Strict):
    """How often a failed attempt is retried, with exponential back-off."""

    max: Whole = Field(default=0, ge=0, le=100, description="retries after the first attempt")
    backoff_s: float = Field(default=10.0, ge=0, le=86400)
    backoff_max_s: float = Field(default=600.0, ge=0, le=7 * 86400)
    max_lost: Whole = Field(default=3, ge=1, le=100,
                          description="attempts lost with their worker before the job fails "
                                      "as a poison job (lost attempts are not retries)")

    def delay_s(self, attempt: int) -> float:
        """Back-off before the attempt after `attempt` (1-based): backoff_s × 2^(attempt-1),
        capped at backoff_max_s."""
        return min(self.backoff_max_s, self.backoff_s * (2 ** max(0, attempt - 1)))
