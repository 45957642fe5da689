"""The Python client: `Client`, `JobHandle`, `ArrayHandle`, the progress display and the
profile that `e31 up` writes for it.

May import: the `e31` core (spec vocabulary, errors) and httpx. Never the store, the
scheduler, the API's internals or `e31_worker`.
"""

from e31.client.client import ArrayHandle, Client, JobHandle

__all__ = ["ArrayHandle", "Client", "JobHandle"]
