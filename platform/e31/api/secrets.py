"""`/v1/secrets`: a tenant's own secrets (docs/security.md, "Secrets").

`PUT /v1/secrets/{name}` stores a value (encrypted with the pool's key before it reaches the
store), `GET /v1/secrets` lists names and dates only, `DELETE /v1/secrets/{name}` removes one.
No route ever answers a value: only the job that names the secret (`secrets: [NAME]`) sees it,
as an environment variable, when an attempt starts. Without a key (`secrets_key`) every route
answers 503 saying so. A tenant reaches only its own secrets; there is no admin view.
Setting and deleting one is written to the audit log (`secret.set`, `secret.delete`, the
name as `tenant/NAME`), in the same transaction; the value never is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from e31.api import errors
from e31.api.schema import NUL
from e31.api.tenancy import _actor
from e31.core.clock import utcnow
from e31.core.errors import SecretsUnavailable
from e31.core.names import ENV_NAME, SECRET_NAME_MAX
from e31.core.records import TenantRecord
from e31.edge.secrets import (
    NO_KEY,
    SECRET_VALUE_MAX_BYTES,
    SecretBox,
    check_secret_name,
    check_secret_value,
)
from e31.edge.settings import Settings
from e31.store import Repo
from e31.store.secrets import SecretInfo

log = logging.getLogger(__name__)

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


def router(settings: Settings, repo: Repo, caller: Callable[..., TenantRecord]) -> APIRouter:
    """The routes, over `repo`, with the pool's key from `settings`; `caller` is the API's
    token dependency."""
    r = APIRouter(tags=["secrets"])
    box = SecretBox.of(settings.secrets_key)

    def sealed() -> SecretBox:
        if box is None:
            raise SecretsUnavailable(NO_KEY)
        return box

    @r.put(PATH + "/{name}", responses={201: {"model": SecretOut, "description": "created"},
                                        **errors.responses(401, 413, 422, 503)})
    def put_secret(name: _Name, body: SecretValue, request: Request, response: Response,
                   t: TenantRecord = Depends(caller)) -> SecretOut:
        """Set the tenant's secret `name` (create it, or replace its value): 201 when new."""
        sealer = sealed()
        check_secret_name(name)
        value = check_secret_value(body.value)
        info, created = repo.put_secret(t.id, name, sealer.encrypt(t.id, name, value),
                                        now=utcnow(), actor=_actor(request, t))
        response.status_code = 201 if created else 200
        log.info("secret_set tenant=%s name=%s created=%s", t.name, name, created)
        return _out(info)

    @r.get(PATH, responses=errors.responses(401, 503))
    def list_secrets(t: TenantRecord = Depends(caller)) -> SecretList:
        """The tenant's secrets: names and dates, never values."""
        sealed()
        return SecretList(secrets=[_out(i) for i in repo.list_secrets(t.id)])

    @r.delete(PATH + "/{name}", responses=errors.responses(401, 404, 422, 503))
    def delete_secret(name: _Name, request: Request,
                      t: TenantRecord = Depends(caller)) -> SecretDeleted:
        """Remove the tenant's secret `name` (404 when it has none); a queued job that names
        it fails at its next attempt's start, with reason setup."""
        sealed()
        check_secret_name(name)
        repo.delete_secret(t.id, name, now=utcnow(), actor=_actor(request, t))
        log.info("secret_deleted tenant=%s name=%s", t.name, name)
        return SecretDeleted(name=name)

    return r
