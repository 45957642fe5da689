"""`e31 tenant create|update|list|show|disable|enable`: tenants, their fair-share weight,
quotas and limits, whether they may use the pool, and their first API token.

Owns: the `tenant` sub-app. On this machine each command migrates the store first and goes
through the repository that `e31.edge.wiring` builds (the audit log names the actor `local`); with
`--url` (E31_URL) and an admin's `--token` (E31_TOKEN) it goes through the admin API instead.
May import: `e31.cli.common`, `e31.cli.remote`, the `e31` core and store (lazily, inside the
commands), `e31.client` (lazily, through `remote`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from e31.cli.common import EXIT_INPUT, HomeOpt, JsonOpt, fail, load_settings, out, print_json
from e31.cli.remote import TokenOpt, UrlOpt, call, tenancy
from e31.core.errors import Conflict, NotFound, SpecError

if TYPE_CHECKING:
    from e31.edge.settings import Settings
    from e31.store import Repo

app = typer.Typer(help="Tenants: weight, quotas, limits, disable and enable.", no_args_is_help=True,
                  rich_markup_mode=None)

WeightOpt = typer.Option(None, "--weight", help="fair-share weight (default 1): a tenant of "
                         "weight 2 gets twice the GPU time of one of weight 1 under contention")
QuotaOpt = typer.Option([], "--quota", help="CLASS=N: at most N GPUs of the class at once "
                        "(repeat for several classes)")
LimitOpt = typer.Option([], "--limit", help="NAME=VALUE: the tenant's own limit over the pool's "
                        "default (max_priority, max_queued, max_array_items, max_request_bytes, "
                        "submit_rate_per_s, submit_burst; repeatable)")


@app.command("create")
def tenant_create(name: str,
                  admin: bool = typer.Option(False, "--admin", help="may manage tenants, read "
                                             "the audit log and every tenant's usage"),
                  weight: float | None = WeightOpt, quota: list[str] = QuotaOpt,
                  limit: list[str] = LimitOpt, url: str | None = UrlOpt,
                  token: str | None = TokenOpt, home: Path | None = HomeOpt,
                  as_json: bool = JsonOpt) -> None:
    """Create a tenant; its first token (named default) is printed once (only its hash is
    stored)."""
    from e31.core.clock import utcnow
    settings = load_settings(home=home)
    quotas = _quotas(quota, settings)
    limits = _limits(limit)
    if url:
        shown = call(tenancy(url, token).create_tenant, name, admin=admin,
                     weight=1.0 if weight is None else weight, quotas=quotas, limits=limits)
        secret = shown.pop("token")
    else:
        repo = _migrated_repo(settings)
        try:
            tenant, secret = repo.create_tenant(name, admin=admin, now=utcnow(),
                                                weight=1.0 if weight is None else weight,
                                                quotas=quotas, limits=limits)
        except (Conflict, SpecError) as exc:
            fail(exc.message, EXIT_INPUT)
        shown = tenant.to_dict()
    if as_json:
        print_json({**shown, "token": secret})
    else:
        out.print(f"tenant {shown['tenant']} created (weight {shown['weight']:g}"
                  f"{_quota_text(shown['quotas'])}{_limits_text(shown['limits'])}); its token "
                  f"(shown once):\n{secret}", highlight=False)


@app.command("update")
def tenant_update(name: str, weight: float | None = WeightOpt, quota: list[str] = QuotaOpt,
                  no_quota: list[str] = typer.Option([], "--no-quota", help="CLASS: drop the "
                                                     "quota of the class (repeatable)"),
                  limit: list[str] = LimitOpt,
                  no_limit: list[str] = typer.Option([], "--no-limit", help="NAME: return the "
                                                     "limit to the pool's default (repeatable)"),
                  outputs_max_bytes: str | None = typer.Option(
                      None, "--outputs-max-bytes", metavar="BYTES|default",
                      help="the most bytes of outputs the tenant's jobs may keep stored "
                           "(0: none); 'default' returns to the pool's tenant_outputs_max_bytes"),
                  url: str | None = UrlOpt, token: str | None = TokenOpt,
                  home: Path | None = HomeOpt, as_json: bool = JsonOpt) -> None:
    """Change a tenant's weight, quotas, limits or outputs quota; the scheduler uses them from
    its next tick, the API from the next request, the workers from the next outputs they
    store."""
    settings = load_settings(home=home)
    quotas = _quotas(quota, settings)
    limits: dict[str, Any] = {**_limits(limit), **{k: None for k in no_limit}}
    if (weight is None and not quotas and not no_quota and not limits
            and outputs_max_bytes is None):
        fail("nothing to change: give --weight, --quota, --no-quota, --limit, --no-limit or "
             "--outputs-max-bytes", EXIT_INPUT)
    outputs_cap = _outputs_cap(outputs_max_bytes)
    if url:
        if outputs_max_bytes is not None:
            fail("--outputs-max-bytes is set on the store of the pool, not with --url",
                 EXIT_INPUT)
        shown = call(tenancy(url, token).update_tenant, name, weight=weight,
                     quotas={**quotas, **{c: None for c in no_quota}}, limits=limits)
        _show(shown, as_json)
        return
    repo = _migrated_repo(settings)
    try:
        tenant = repo.update_tenant(name, weight=weight, quotas=quotas, drop_quotas=no_quota,
                                    limits=limits or None)
        outputs = (None if outputs_max_bytes is None
                   else repo.set_outputs_quota(name, outputs_cap))
    except (NotFound, SpecError) as exc:
        fail(exc.message, EXIT_INPUT)
    shown = tenant.to_dict()
    text = _text(shown)    # its limits too, as list and show print them (issue 32, edge 11)
    if outputs is not None:   # asked about: its outputs quota and what it uses of it
        from e31.edge import wiring
        cap = (wiring.artifacts(settings).outputs_cap_bytes(settings.tenant_outputs_max_bytes)
               if outputs.max_bytes is None else outputs.max_bytes)
        shown.update(outputs_max_bytes=cap, outputs_bytes=outputs.used_bytes,
                     outputs_max_is_default=outputs.max_bytes is None)
        text += (f", outputs {outputs.used_bytes} of {cap} bytes"
                 f"{' (the default)' if outputs.max_bytes is None else ''}")
    if as_json:
        print_json(shown)
    else:
        out.print(text, highlight=False)


@app.command("list")
def tenant_list(url: str | None = UrlOpt, token: str | None = TokenOpt,
                home: Path | None = HomeOpt, as_json: bool = JsonOpt) -> None:
    """Every tenant: weight, quotas, limits, whether it is disabled."""
    if url:
        tenants = call(tenancy(url, token).list_tenants)
    else:
        tenants = [t.to_dict() for t in _migrated_repo(load_settings(home=home)).list_tenants()]
    if as_json:
        print_json({"tenants": tenants})
        return
    for t in tenants:
        out.print(_text(t), highlight=False)


@app.command("show")
def tenant_show(name: str, url: str | None = UrlOpt, token: str | None = TokenOpt,
                home: Path | None = HomeOpt, as_json: bool = JsonOpt) -> None:
    """One tenant: weight, quotas, limits, whether it is disabled."""
    if url:
        shown = call(tenancy(url, token).get_tenant, name)
    else:
        try:
            shown = _migrated_repo(load_settings(home=home)).get_tenant(name).to_dict()
        except NotFound as exc:
            fail(exc.message, EXIT_INPUT)
    _show(shown, as_json)


@app.command("disable")
def tenant_disable(name: str, url: str | None = UrlOpt, token: str | None = TokenOpt,
                   home: Path | None = HomeOpt, as_json: bool = JsonOpt) -> None:
    """Refuse the tenant's tokens (403) and hold its queued jobs (pending reason
    tenant_disabled); its running jobs run on. `enable` undoes it."""
    _set_disabled(name, True, url=url, token=token, home=home, as_json=as_json)


@app.command("enable")
def tenant_enable(name: str, url: str | None = UrlOpt, token: str | None = TokenOpt,
                  home: Path | None = HomeOpt, as_json: bool = JsonOpt) -> None:
    """Accept a disabled tenant's tokens again; its queued jobs start from the scheduler's next
    tick."""
    _set_disabled(name, False, url=url, token=token, home=home, as_json=as_json)


def _set_disabled(name: str, disabled: bool, *, url: str | None, token: str | None,
                  home: Path | None, as_json: bool) -> None:
    if url:
        shown = call(tenancy(url, token).set_disabled, name, disabled)
    else:
        from e31.core.clock import utcnow
        repo = _migrated_repo(load_settings(home=home))
        try:
            shown = repo.set_tenant_disabled(name, disabled=disabled, now=utcnow()).to_dict()
        except NotFound as exc:
            fail(exc.message, EXIT_INPUT)
    _show(shown, as_json)


def _show(shown: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print_json(shown)
    else:
        out.print(_text(shown), highlight=False)


def _text(t: dict[str, Any]) -> str:
    """One line for a tenant, as list and show print it."""
    limits = _limits_text(t["limits"])
    state = f", disabled since {t['disabled_at']}" if t["disabled"] else ""
    return (f"tenant {t['tenant']}{' (admin)' if t['admin'] else ''}: weight {t['weight']:g}"
            f"{_quota_text(t['quotas'])}{limits}{state}")


def _limits_text(limits: dict[str, Any] | None) -> str:
    """", limits max_priority=7, max_queued=50", or nothing for a tenant with none."""
    return ", limits " + ", ".join(f"{k}={v}" for k, v in limits.items()) if limits else ""


def _limits(items: list[str]) -> dict[str, Any]:
    """Parse `--limit NAME=VALUE` flags (a number each), checked as the admin API checks them."""
    from e31.core.tenantlimits import check_limits
    raw: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        try:
            raw[key] = json.loads(value) if sep else None
        except ValueError:
            raw[key] = None
        if not sep or not isinstance(raw[key], int | float):
            fail(f"--limit {item!r}: expected NAME=NUMBER, e.g. max_priority=7", EXIT_INPUT)
    try:
        return check_limits(raw)
    except SpecError as exc:
        fail(exc.message, EXIT_INPUT)


def _migrated_repo(settings: Settings) -> Repo:
    """The store, its schema first brought to the newest revision (a fresh home works)."""
    from e31.edge import wiring
    from e31.store.migrate import upgrade
    repo = wiring.repo(settings)
    upgrade(repo.engine)
    return repo


def _quotas(items: list[str], settings: Settings) -> dict[str, int]:
    """Parse `--quota CLASS=N` flags, refusing a malformed one or an unknown class."""
    from e31.store.tenants import check_quotas
    raw: dict[str, Any] = {}
    for item in items:
        cls, sep, n = item.partition("=")
        if not sep or not cls or not n.strip().isdigit():
            fail(f"--quota {item!r}: expected CLASS=N, e.g. gpu80=8", EXIT_INPUT)
        raw[cls] = int(n)
    try:
        return check_quotas(raw, [c.name for c in settings.size_classes])
    except SpecError as exc:
        fail(exc.message, EXIT_INPUT)


def _outputs_cap(value: str | None) -> int | None:
    """`--outputs-max-bytes`: a whole number of bytes, or `default` (None: the pool's)."""
    if value is None or value == "default":
        return None
    if not value.isdigit():
        fail(f"--outputs-max-bytes {value!r}: expected a whole number of bytes or 'default'",
             EXIT_INPUT)
    return int(value)


def _quota_text(quotas: dict[str, int]) -> str:
    """`, quotas gpu24=2, gpu80=8` after a tenant's weight, or nothing without quotas."""
    if not quotas:
        return ""
    return ", quotas " + ", ".join(f"{c}={n}" for c, n in sorted(quotas.items()))
