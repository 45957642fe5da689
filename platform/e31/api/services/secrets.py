"""A tenant's own secrets (docs/security.md, "Secrets"); the routes are `e31.api.routes.secrets`.

A value is encrypted with the pool's key (`secrets_key`) before it reaches the store, and never
read back: only the job that names the secret (`secrets: [NAME]`) sees it, as an environment
variable, when an attempt starts. Without a key every operation refuses with
`SecretsUnavailable` (503) saying so. A tenant reaches only its own secrets. Setting and
deleting one is written to the audit log (`secret.set`, `secret.delete`, the name as
`tenant/NAME`) in the same transaction; the value never is.
"""

from __future__ import annotations

import builtins
import logging

from e31.core.clock import utcnow
from e31.core.errors import SecretsUnavailable
from e31.core.records import Actor, TenantRecord
from e31.edge.secrets import NO_KEY, SecretBox, check_secret_name, check_secret_value
from e31.edge.settings import Settings
from e31.store import Repo
from e31.store.secrets import SecretInfo

log = logging.getLogger(__name__)


class SecretService:
    """The secrets of each tenant, over one store and the pool's key."""

    def __init__(self, *, settings: Settings, repo: Repo) -> None:
        self._repo = repo
        self._box = SecretBox.of(settings.secrets_key)

    def put(self, tenant: TenantRecord, name: str, value: str, *,
            actor: Actor) -> tuple[SecretInfo, bool]:
        """Set the tenant's secret `name` (create it, or replace its value); whether it is
        new."""
        sealer = self._sealed()
        check_secret_name(name)
        value = check_secret_value(value)
        info, created = self._repo.put_secret(tenant.id, name,
                                              sealer.encrypt(tenant.id, name, value),
                                              now=utcnow(), actor=actor)
        log.info("secret_set tenant=%s name=%s created=%s", tenant.name, name, created)
        return info, created

    def list(self, tenant: TenantRecord) -> builtins.list[SecretInfo]:
        """The tenant's secrets: names and dates, never values."""
        self._sealed()
        return self._repo.list_secrets(tenant.id)

    def delete(self, tenant: TenantRecord, name: str, *, actor: Actor) -> None:
        """Remove the tenant's secret `name` (`NotFound` when it has none)."""
        self._sealed()
        check_secret_name(name)
        self._repo.delete_secret(tenant.id, name, now=utcnow(), actor=actor)
        log.info("secret_deleted tenant=%s name=%s", tenant.name, name)

    def _sealed(self) -> SecretBox:
        if self._box is None:
            raise SecretsUnavailable(NO_KEY)
        return self._box
