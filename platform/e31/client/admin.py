"""`Tenancy`: a tenant's own API tokens, and (with an admin token) tenants and the audit log,
over `Client.request` — the calls behind `e31 token`, `e31 tenant` and `e31 audit` when they
talk to an API.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from e31.client.client import Client


class Tenancy:
    """Tokens, tenants and the audit log through one `Client` (its token decides what may be
    done: a tenant's own tokens, or everything with an admin's)."""

    def __init__(self, client: Client) -> None:
        self._client = client

    # -- tokens (`/v1/tokens`) ---------------------------------------------------------------

    def list_tokens(self, tenant: str | None = None) -> list[dict[str, Any]]:
        return list(self._client.request("GET", "/v1/tokens", params=_tenant(tenant))
                    .json()["tokens"])

    def create_token(self, name: str, *, expires_in_s: int | None = None,
                     expires_at: str | None = None,
                     tenant: str | None = None) -> dict[str, Any]:
        """A new token: the answer's `token` is shown this once. It expires `expires_in_s`
        from now or at `expires_at` (an ISO 8601 instant with its zone, kept exactly)."""
        body: dict[str, Any] = {"name": name}
        if expires_in_s is not None:
            body["expires_in_s"] = expires_in_s
        if expires_at is not None:
            body["expires_at"] = expires_at
        answer: dict[str, Any] = self._client.request("POST", "/v1/tokens", json=body,
                                                      params=_tenant(tenant)).json()
        return answer

    def revoke_token(self, name: str, *, tenant: str | None = None) -> dict[str, Any]:
        answer: dict[str, Any] = self._client.request("DELETE", f"/v1/tokens/{name}",
                                                      params=_tenant(tenant)).json()
        return answer

    # -- tenants (`/v1/admin/tenants`, admin tokens only) ---------------------------------

    def list_tenants(self) -> list[dict[str, Any]]:
        return list(self._client.request("GET", "/v1/admin/tenants").json()["tenants"])

    def get_tenant(self, name: str) -> dict[str, Any]:
        answer: dict[str, Any] = self._client.request("GET", f"/v1/admin/tenants/{name}").json()
        return answer

    def create_tenant(self, name: str, *, admin: bool = False, weight: float = 1.0,
                      quotas: Mapping[str, int] | None = None,
                      limits: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """A new tenant; the answer's `token` (its first, named default) is shown this once."""
        body = {"name": name, "admin": admin, "weight": weight, "quotas": dict(quotas or {}),
                "limits": dict(limits or {})}
        answer: dict[str, Any] = self._client.request("POST", "/v1/admin/tenants",
                                                      json=body).json()
        return answer

    def update_tenant(self, name: str, *, weight: float | None = None,
                      quotas: Mapping[str, int | None] | None = None,
                      limits: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Change what is given: a quota or limit of None drops it."""
        body: dict[str, Any] = {}
        if weight is not None:
            body["weight"] = weight
        if quotas:
            body["quotas"] = dict(quotas)
        if limits:
            body["limits"] = dict(limits)
        answer: dict[str, Any] = self._client.request("PATCH", f"/v1/admin/tenants/{name}",
                                                      json=body).json()
        return answer

    def set_disabled(self, name: str, disabled: bool) -> dict[str, Any]:
        action = "disable" if disabled else "enable"
        answer: dict[str, Any] = self._client.request(
            "POST", f"/v1/admin/tenants/{name}/{action}").json()
        return answer

    def audit(self, *, since: str | None = None, limit: int | None = None) -> list[dict[str, Any]]:
        params: dict[str, Any] = {}
        if since is not None:
            params["since"] = since
        if limit is not None:
            params["limit"] = limit
        return list(self._client.request("GET", "/v1/admin/audit", params=params)
                    .json()["events"])


def _tenant(tenant: str | None) -> dict[str, str]:
    return {"tenant": tenant} if tenant else {}
