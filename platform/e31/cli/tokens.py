"""`e31 token create|list|revoke`: a tenant's own API tokens (an admin's: any tenant's, with
`--tenant`), through the API the client is configured for (E31_URL/E31_TOKEN or the profile
`e31 up` wrote).

Owns: the `token` sub-app. May import: `e31.cli.common`, `e31.cli.remote`, the `e31` core.
"""

from __future__ import annotations

from typing import Any

import typer

from e31.cli.common import JsonOpt, out, print_json
from e31.cli.remote import call, tenancy, token_expiry

app = typer.Typer(help="Your tenant's API tokens: create, list, revoke.", no_args_is_help=True,
                  rich_markup_mode=None)

TenantOpt = typer.Option(None, "--tenant", help="another tenant's tokens (an admin's token only)")


@app.command("create")
def token_create(name: str,
                 expires_in: str | None = typer.Option(
                     None, "--expires-in", help="refused after this long: 90m, 12h, 30d, 2w"),
                 expires_at: str | None = typer.Option(
                     None, "--expires-at", help="refused from this RFC 3339 time (seconds "
                                                "and zone), kept exactly: 2027-01-31T00:00:00Z"),
                 tenant: str | None = TenantOpt, as_json: bool = JsonOpt) -> None:
    """Make a new named token; it is printed once (only its hash is stored)."""
    made = call(tenancy().create_token, name, tenant=tenant,
                **token_expiry(expires_in, expires_at))
    if as_json:
        print_json({"token": made["token"], **{k: v for k, v in made.items() if k != "token"}})
        return
    until = f", expires {made['expires_at']}" if made["expires_at"] else ""
    out.print(f"token {made['name']} of tenant {made['tenant']}{until} (shown once):",
              highlight=False)
    print(made["token"])


@app.command("list")
def token_list(tenant: str | None = TenantOpt, as_json: bool = JsonOpt) -> None:
    """The tenant's live tokens: name, prefix, created, last used (noted at most once a
    minute), expiry. Never a token."""
    tokens = call(tenancy().list_tokens, tenant)
    if as_json:
        print_json({"tokens": tokens})
        return
    from rich.table import Table
    table = Table("NAME", "PREFIX", "CREATED", "LAST USED", "EXPIRES")
    for t in tokens:
        table.add_row(t["name"], (t["prefix"] or "") + "…", _short(t["created_at"]),
                      _short(t["last_used_at"]) or "never",
                      (_short(t["expires_at"]) or "never") + (" (expired)" if t["expired"] else ""))
    out.print(table)


@app.command("revoke")
def token_revoke(name: str, tenant: str | None = TenantOpt, as_json: bool = JsonOpt) -> None:
    """Revoke a token: every request with it is refused from now on. Jobs hold no token, so
    queued and running jobs carry on."""
    revoked: dict[str, Any] = call(tenancy().revoke_token, name, tenant=tenant)
    if as_json:
        print_json(revoked)
    else:
        out.print(f"token {revoked['name']} of tenant {revoked['tenant']} revoked",
                  highlight=False)


def _short(ts: str | None) -> str:
    """An ISO time to the second, as a table shows it."""
    return ts[:19].replace("T", " ") if ts else ""
