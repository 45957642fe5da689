"""The HTTP API: `create_app(settings)`, the routes (`routes`, one module per noun), the one
mapping of errors to HTTP answers (`errors`) and the operations behind the routes (`services`,
one service per noun), each scoped to the caller's tenant.

Owns: the FastAPI app, authentication by tenant token (`auth`), and the validation of what
arrives: a request body becomes a typed `JobSpec` once, at the route, and the service passes
that object on to the store.

May import: the `e31` core, `e31.store`, and `e31.scheduling`'s explanations (the pending
reason, the queue overview, the tenant views they rest on). Never `e31.client`, `e31.cli`,
`e31.local` or `e31_worker`.
"""

from e31.api.app import create_app

__all__ = ["create_app"]
