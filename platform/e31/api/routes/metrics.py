"""`GET /metrics`: the pool's Prometheus series (`e31.api.services.metrics`).

Guarded apart from the tenants' tokens: with `metrics_token` set, a scrape must send it as
`Authorization: Bearer <token>` (401 otherwise); without one, only a client on the loopback
address is answered (403 otherwise), which keeps the series private to the host unless an
operator chose a token.
"""

from __future__ import annotations

import hmac
import ipaddress

from fastapi import APIRouter, Request, Response
from fastapi.responses import PlainTextResponse

from e31.api.services.metrics import CONTENT_TYPE, MetricsService
from e31.edge.settings import Settings

PATH = "/metrics"


def router(settings: Settings, svc: MetricsService) -> APIRouter:
    """The `/metrics` route, guarded by the `metrics_token` of `settings`."""
    r = APIRouter()

    @r.get(PATH, include_in_schema=False)
    def metrics_text(request: Request) -> Response:
        refused = refusal(request, settings.metrics_token)
        if refused is not None:
            return refused
        return Response(svc.text(), media_type=CONTENT_TYPE)

    return r


def refusal(request: Request, token: str) -> Response | None:
    """Why this scrape is refused, as the answer to send; None when it may read."""
    if token:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(),
                                                              token.encode()):
            return None
        return PlainTextResponse("metrics need the metrics token: send 'Authorization: Bearer "
                                 "<metrics_token>'\n", status_code=401,
                                 headers={"WWW-Authenticate": "Bearer"})
    if _loopback(request.client.host if request.client else ""):
        return None
    return PlainTextResponse("metrics answer only loopback clients while no metrics_token is "
                             "set (E31_METRICS_TOKEN)\n", status_code=403)


def _loopback(host: str) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback
