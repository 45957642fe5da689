"""`/v1/bundles`: a tenant's code and data bundles, uploaded once under their sha256
(`e31.api.services.bundles` says what is checked).

`HEAD /v1/bundles/sha256:<hex>` answers 200 when the caller's tenant holds the bundle (then the
client uploads nothing; `X-E31-Bundle-Bytes` is its size) and 404 otherwise.
`PUT /v1/bundles/sha256:<hex>` streams the body into the store: 201 when stored, 200 when the
tenant held it already. The upload is bounded by `bundle_max_bytes`, not by the request body
limit (the app exempts `BUNDLES_PATH` from it).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from e31.api import errors
from e31.api.auth import Caller
from e31.api.services.bundles import BundleService

BUNDLES_PATH = "/v1/bundles/"
SIZE_HEADER = "X-E31-Bundle-Bytes"


def router(svc: BundleService) -> APIRouter:
    """`HEAD` and `PUT /v1/bundles/{digest}` for the caller's tenant."""
    r = APIRouter()

    @r.head(BUNDLES_PATH + "{digest}", tags=["bundles"], responses={
        200: {"description": "your tenant holds the bundle",
              "headers": {SIZE_HEADER: {"schema": {"type": "integer"}}}},
        **errors.responses(401, 404, 422, 503)})
    def head_bundle(digest: str, t: Caller) -> Response:
        """200 when your tenant holds the bundle (its size in X-E31-Bundle-Bytes), else 404."""
        return Response(status_code=200, headers={SIZE_HEADER: str(svc.size(t, digest))})

    @r.put(BUNDLES_PATH + "{digest}", status_code=201, tags=["bundles"], responses={
        200: {"description": "your tenant held the bundle already"},
        **errors.responses(401, 409, 413, 422, 503)})
    async def put_bundle(digest: str, request: Request, t: Caller) -> JSONResponse:
        """Upload a bundle (an uncompressed tar) under its sha256; 201 when stored, 200 when
        your tenant held it already."""
        length = request.headers.get("content-length")
        answer = await svc.receive(t, digest, request.stream(),
                                   int(length) if length and length.isdigit() else None)
        return JSONResponse(answer, status_code=201 if answer["stored"] else 200)

    return r
