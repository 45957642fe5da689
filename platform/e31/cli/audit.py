"""`e31 audit`: the audit log — every admin action and token change, who, what, when and from
where — read from the store of this machine, or with `--url` (E31_URL) and an admin's token
from an API.

Owns: the `audit` command. May import: `e31.cli.common`, `e31.cli.remote`, the `e31` core
and store (lazily, inside the command).
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import typer

from e31.cli.common import EXIT_INPUT, HomeOpt, JsonOpt, fail, load_settings, out, print_json
from e31.cli.remote import TokenOpt, UrlOpt, call, tenancy

app = typer.Typer()

LIMIT_DEFAULT = 1000


@app.command("audit")
def audit(since: str | None = typer.Option(None, "--since", help="only lines at or after this "
                                           "ISO 8601 time (UTC if no zone)"),
          limit: int = typer.Option(LIMIT_DEFAULT, "--limit", min=1, max=10_000,
                                    help="the newest N lines"),
          url: str | None = UrlOpt, token: str | None = TokenOpt,
          home: Path | None = HomeOpt, as_json: bool = JsonOpt) -> None:
    """Every admin action and token change, oldest first: when, who (tenant and key, or
    local for the CLI on the store), what, on what, from where."""
    at = _since(since)
    if url:
        events = call(tenancy(url, token).audit, since=at.isoformat() if at else None,
                      limit=limit)
    else:
        from e31.edge import wiring
        repo = wiring.repo(load_settings(home=home))
        events = [e.to_dict() for e in repo.audit_log(since=at, limit=limit)]
    if as_json:
        print_json({"events": events})
        return
    for e in events:
        out.print(_line(e), highlight=False, markup=False)


def _since(text: str | None) -> datetime | None:
    if text is None:
        return None
    try:
        at = datetime.fromisoformat(text)
    except ValueError:
        fail(f"--since {text!r}: expected an ISO 8601 time, e.g. 2026-12-01T00:00:00Z",
             EXIT_INPUT)
    return at if at.tzinfo else at.replace(tzinfo=UTC)


def _line(e: dict[str, Any]) -> str:
    who = e["actor"] + (f" ({e['actor_key']})" if e.get("actor_key") else "")
    where = f" from {e['source']}" if e.get("source") else ""
    detail = f" {e['detail']}" if e.get("detail") else ""
    return f"{e['at']} {who}{where}: {e['action']} {e['target']}{detail}"
