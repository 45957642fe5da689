"""The Python client: `Client` (`client`), the handles it returns, `JobHandle` and
`ArrayHandle` (`handles`), the progress bars (`progress`) and the profile that `e31 up`
writes for it (`profile`).

Owns: everything a user's program needs to submit work and follow it over HTTP.

May import: the `e31` core's job vocabulary and errors (`e31.core.spec`, `e31.core.errors`),
httpx, and rich for the progress bars. Never the store or the edge (`e31.edge.settings`,
`e31.edge.wiring`: a client holds a URL and a token, not the platform's configuration), the
scheduler, the API's internals, the CLI, the local stack or `e31_worker`.
"""

from e31.client.client import Client
from e31.client.handles import ArrayHandle, JobHandle

__all__ = ["ArrayHandle", "Client", "JobHandle"]
