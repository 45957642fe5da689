"""The one error hierarchy of E31 Batch.

A root (`E31Error`), a sub-root per subsystem, and every class raised somewhere. Every error
has a one-line "Raised when…" docstring, which is also its default message. The API maps
these classes to HTTP status codes in one place (`e31.api.errors`).
"""

from __future__ import annotations

from typing import Any


class E31Error(Exception):
    """Raised when E31 Batch cannot do what was asked."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


class ConfigError(E31Error):
    """Raised when a setting or the configuration file is invalid."""


class SpecError(E31Error):
    """Raised when a job spec is invalid."""

    def __init__(self, errors: list[dict[str, str]] | None = None) -> None:
        self.errors = errors or []
        super().__init__("; ".join(f"{e['field']}: {e['reason']}" for e in self.errors))

    @classmethod
    def one(cls, field: str, reason: str) -> SpecError:
        return cls([{"field": field, "reason": reason}])


class SpecConflict(SpecError):
    """Raised when a spec names a bundle or a dependency its tenant lacks, or one that failed."""


class SpecForbidden(SpecError):
    """Raised when a spec asks for what the pool lets no tenant use (a file:// input)."""


class TooLarge(E31Error):
    """Raised when an upload (a bundle) is larger than the limit it is told with."""

    def __init__(self, message: str | None = None, *, limit_bytes: int = 0) -> None:
        self.limit_bytes = limit_bytes
        super().__init__(message)


class LimitExceeded(E31Error):
    """Raised when a tenant is past its submit rate or holds its most queued jobs; try later."""

    def __init__(self, message: str | None = None, *, retry_after_s: int = 1) -> None:
        self.retry_after_s = max(1, retry_after_s)
        super().__init__(message)


class SecretsUnavailable(E31Error):
    """Raised when secrets are asked for and this pool has no secrets key (secrets_key)."""


class SetupError(E31Error):
    """Raised when a job's code, environment or inputs cannot be prepared for it on a worker."""


class SetupTransient(SetupError):
    """Raised when a job's setup meets a fault of the pool's that may pass (a 503, a reset)."""


class StoreError(E31Error):
    """Raised when the results store fails."""


class StoreUnavailable(StoreError):
    """Raised when the results store cannot be reached."""


class NotFound(StoreError):
    """Raised when a job, tenant or output does not exist for the caller."""


class LinkRefused(NotFound):
    """Raised when a job's file is a link or not a plain file: it is neither stored nor served."""


class Conflict(StoreError):
    """Raised when a change conflicts with what is stored already (a taken tenant name)."""


class IllegalTransition(StoreError):
    """Raised when a job would move between two states the transitions table does not allow."""


class AuthError(E31Error):
    """Raised when a request carries no valid API token."""


class Forbidden(E31Error):
    """Raised when a valid token asks for what only an admin may see."""


class SchedulingError(E31Error):
    """Raised when the scheduler cannot publish a job."""


class ClientError(E31Error):
    """Raised when the API answers a client request with an error."""

    def __init__(self, message: str | None = None, *, status_code: int = 0,
                 body: Any = None) -> None:
        self.status_code = status_code
        self.body = body
        super().__init__(message)


class JobFailed(ClientError):
    """Raised when a waited-for job ended without succeeding."""

    def __init__(self, status: dict[str, Any]) -> None:
        self.status = status
        self.reason: str = status.get("reason") or status.get("state") or "failed"
        detail = status.get("error") or ""
        msg = f"job {status.get('id')} {status.get('state')}: {self.reason}"
        super().__init__(f"{msg}: {detail}" if detail else msg)


class FunctionError(ClientError):
    """Raised when a function's call cannot be sent to the pool or its value cannot return."""


class RemoteError(JobFailed):
    """Raised when a function's job failed with an exception that could not travel back.

    Its message holds the remote traceback (`traceback_text`)."""

    def __init__(self, status: dict[str, Any], traceback_text: str = "") -> None:
        super().__init__(status)
        self.traceback_text = traceback_text
        if traceback_text:
            self.args = (f"{self.args[0]}\n\nremote traceback:\n{traceback_text}",)


class JobTimeout(ClientError):
    """Raised when waiting for a job took longer than the caller's timeout."""
