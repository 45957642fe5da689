"""E31 Batch: batch GPU jobs for many teams on a shared pool of GPUs (control plane)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from e31.client import ArrayHandle, Client, JobHandle
    from e31.core.errors import E31Error, JobFailed, RemoteError
    from e31.functions import Function, function

__all__ = ["ArrayHandle", "Client", "E31Error", "Function", "JobFailed", "JobHandle",
           "RemoteError", "__version__", "function"]


def __getattr__(name: str) -> Any:
    # Lazy, so `import e31` stays light for workers and the CLI's fast paths.
    if name in ("ArrayHandle", "Client", "JobHandle"):
        from e31 import client
        return getattr(client, name)
    if name in ("function", "Function"):
        from e31 import functions
        return getattr(functions, name)
    if name in ("JobFailed", "E31Error", "RemoteError"):
        from e31.core import errors
        return getattr(errors, name)
    raise AttributeError(name)
