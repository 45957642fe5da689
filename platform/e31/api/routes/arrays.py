"""`/v1/arrays`: submit N jobs as one; read, cancel, retry and list the results of the whole
(`e31.api.services.arrays`). The envelope is typed here; each item is validated once, by the
service, so an error names its item.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from e31.api import errors
from e31.api.auth import Caller
from e31.api.requestlimits import QueryBool, body_bytes
from e31.api.services.arrays import ArrayService
from e31.ops.sweep import MAX_ARRAY_ITEMS


class ArraySubmission(BaseModel):
    """N jobs as one array. Items are validated one by one, so an error names its item."""

    model_config = ConfigDict(extra="forbid", strict=True)
    name: str | None = Field(default=None, description="the array's name; items without a name "
                                                       "of their own are called NAME[i]")
    items: list[Any] = Field(description=f"job specs as for POST /v1/jobs, 1 to {MAX_ARRAY_ITEMS}")
    defaults: dict[str, Any] | None = Field(
        default=None, description="spec fields under every item (the item wins; params and env "
                                  "merge key by key)")


def router(svc: ArrayService) -> APIRouter:
    """The routes of `/v1/arrays`."""
    r = APIRouter()

    @r.post("/v1/arrays", status_code=201, tags=["arrays"],
            responses=errors.responses(401, 403, 409, 413, 422, 429, 503))
    def submit_array(body: ArraySubmission, t: Caller, request: Request) -> dict[str, Any]:
        status = svc.submit(t, body.items, name=body.name, defaults=body.defaults,
                            body_bytes=body_bytes(request)).to_status()
        status["jobs"] = [item["id"] for item in status.pop("items")]
        return status

    @r.get("/v1/arrays/{array_id}", tags=["arrays"],
           responses=errors.responses(401, 404, 422, 503))
    def get_array(array_id: str, t: Caller,
                  items: Annotated[QueryBool, Query(description="list every item")] = True,
                  ) -> dict[str, Any]:
        return svc.get(t, array_id, items=items).to_status()

    @r.post("/v1/arrays/{array_id}/cancel", tags=["arrays"],
            responses=errors.responses(401, 404, 503))
    def cancel_array(array_id: str, t: Caller) -> dict[str, Any]:
        return svc.cancel(t, array_id).to_status()

    @r.post("/v1/arrays/{array_id}/retry", tags=["arrays"],
            responses=errors.responses(401, 404, 503))
    def retry_array(array_id: str, t: Caller) -> dict[str, Any]:
        """Queue the failed and cancelled items again, as their next attempt, and the jobs
        that their failure had cancelled (a merge after the array); `resubmitted` and
        `rearmed` name them."""
        return svc.retry(t, array_id).to_status()

    @r.get("/v1/arrays/{array_id}/manifest", tags=["arrays"],
           responses=errors.responses(401, 404, 503))
    def array_manifest(array_id: str, t: Caller) -> dict[str, Any]:
        return svc.manifest(t, array_id).to_dict()

    return r
