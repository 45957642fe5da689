"""`/v1/secrets`: a tenant's own secrets (docs/security.md, "Secrets"; `e31.api.services.secrets`).

`PUT /v1/secrets/{name}` stores a value (encrypted with the pool's key before it reaches the
store), `GET /v1/secrets` lists names and dates only, `DELETE /v1/secrets/{name}` removes one.
No route ever answers a value. Without a key (`secrets_key`) every route answers 503 saying so.
A tenant reaches only its own secrets; there is no admin view.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from e31.api import errors
from e31.api.auth import Caller, actor
from e31.api.schema import NUL
from e31.api.services.secrets import SecretService
from e31.core.names import ENV_NAME, SECRET_NAME_MAX
from e31.edge.secrets import SECRET_VALUE_MAX_BYTES
from e31.store.secrets import SecretInfo

PATH = "/v1/secrets"
_Name = Annotated[str, Path(pattern=ENV_NAME.pattern, max_length=SECRET_NAME_MAX,
                            description="an environment variable's name, not E31_* or "
                                        "CUDA_VISIBLE_DEVICES")]


class SecretValue(BaseModel):
    """The body of `PUT /v1/secrets/{name}`."""

    model_config = ConfigDict(extra="forbid", strict=True)
    # The document says what e31.edge.secrets refuses (a NUL: an environment variable cannot hold
    # one), so that a body it allows is taken (schemathesis found the gap).
    value: str = Field(min_length=1, max_length=SECRET_VALUE_MAX_BYTES,
                       description=f"the secret, at most {SECRET_VALUE_MAX_BYTES} bytes of "
                                   "UTF-8 without NUL; never answered back",
                       json_schema_extra={"not": {"pattern": NUL}})


class SecretOut(BaseModel):
    """A secret as its tenant may read it back: name and dates, never the value."""

    name: str
    created_at: str
    updated_at: str


class SecretDeleted(BaseModel):
    name: str
    deleted: bool = True


class SecretList(BaseModel):
    secrets: list[SecretOut]


def _out(info: SecretInfo) -> SecretOut:
    return SecretOut(**info.to_dict())


def router(svc: SecretService) -> APIRouter:
    """The routes, over the tenant's secrets."""
    r = APIRouter(tags=["secrets"])

    @r.put(PATH + "/{name}", responses={201: {"model": SecretOut, "description": "created"},
                                        **errors.responses(401, 413, 422, 503)})
    def put_secret(name: _Name, body: SecretValue, request: Request, response: Response,
                   t: Caller) -> SecretOut:
        """Set the tenant's secret `name` (create it, or replace its value): 201 when new."""
        info, created = svc.put(t, name, body.value, actor=actor(request, t))
        response.status_code = 201 if created else 200
        return _out(info)

    @r.get(PATH, responses=errors.responses(401, 503))
    def list_secrets(t: Caller) -> SecretList:
        """The tenant's secrets: names and dates, never values."""
        return SecretList(secrets=[_out(i) for i in svc.list(t)])

    @r.delete(PATH + "/{name}", responses=errors.responses(401, 404, 422, 503))
    def delete_secret(name: _Name, request: Request,
                      t: Caller) -> SecretDeleted:
        """Remove the tenant's secret `name` (404 when it has none); a queued job that names
        it fails at its next attempt's start, with reason setup."""
        svc.delete(t, name, actor=actor(request, t))
        return SecretDeleted(name=name)

    return r
