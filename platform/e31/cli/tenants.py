"""`e31 tenant create|update`: tenants, their fair-share weight and quotas, and API tokens.

Owns: the `tenant` sub-app. Both commands migrate the store first and go through the
repository that `e31.wiring` builds (with the pool's fair-share half-life).
May import: `e31.cli.common`, the `e31` core and store (lazily, inside the commands).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from e31.cli.common import EXIT_INPUT, HomeOpt, JsonOpt, fail, load_settings, out, print_json
from e31.errors import Conflict, NotFound, SpecError

if TYPE_CHECKING:
    from e31.settings import Settings
    from e31.store import Repo

app = typer.Typer(help="Tenants and their API tokens.", no_args_is_help=True,
                  rich_markup_mode=None)

WeightOpt = typer.Option(None, "--weight", help="fair-share weight (default 1): a tenant of "
                         "weight 2 gets twice the GPU time of one of weight 1 under contention")
QuotaOpt = typer.Option([], "--quota", help="CLASS=N: at most N GPUs of the class at once "
                        "(repeat for several classes)")


@app.command("create")
def tenant_create(name: str,
                  admin: bool = typer.Option(False, "--admin",
                                             help="may read every tenant's usage"),
                  weight: float | None = WeightOpt, quota: list[str] = QuotaOpt,
                  home: Path | None = HomeOpt, as_json: bool = JsonOpt) -> None:
    """Create a tenant; its token is printed once (only its hash is stored)."""
    from e31.clock import utcnow
    settings = load_settings(home=home)
    quotas = _quotas(quota, settings)
    repo = _migrated_repo(settings)
    try:
        tenant, token = repo.create_tenant(name, admin=admin, now=utcnow(),
                                           weight=1.0 if weight is None else weight,
                                           quotas=quotas)
    except (Conflict, SpecError) as exc:
        fail(exc.message, EXIT_INPUT)
    if as_json:
        print_json({**tenant.to_dict(), "token": token})
    else:
        out.print(f"tenant {tenant.name} created (weight {tenant.weight:g}"
                  f"{_quota_text(tenant.quotas)}); its token (shown once):\n{token}")


@app.command("update")
def tenant_update(name: str, weight: float | None = WeightOpt, quota: list[str] = QuotaOpt,
                  no_quota: list[str] = typer.Option([], "--no-quota", help="CLASS: drop the "
                                                     "quota of the class (repeatable)"),
                  outputs_max_bytes: str | None = typer.Option(
                      None, "--outputs-max-bytes", metavar="BYTES|default",
                      help="the most bytes of outputs the tenant's jobs may keep stored "
                           "(0: none); 'default' returns to the pool's tenant_outputs_max_bytes"),
                  home: Path | None = HomeOpt, as_json: bool = JsonOpt) -> None:
    """Change a tenant's weight, quotas or outputs quota; the scheduler uses them from its next
    tick, the workers from the next outputs they store."""
    settings = load_settings(home=home)
    quotas = _quotas(quota, settings)
    if weight is None and not quotas and not no_quota and outputs_max_bytes is None:
        fail("nothing to change: give --weight, --quota, --no-quota or --outputs-max-bytes",
             EXIT_INPUT)
    outputs_cap = _outputs_cap(outputs_max_bytes)
    repo = _migrated_repo(settings)
    try:
        tenant = repo.update_tenant(name, weight=weight, quotas=quotas, drop_quotas=no_quota)
        outputs = (None if outputs_max_bytes is None
                   else repo.set_outputs_quota(name, outputs_cap))
    except (NotFound, SpecError) as exc:
        fail(exc.message, EXIT_INPUT)
    shown = tenant.to_dict()
    text = f"tenant {tenant.name}: weight {tenant.weight:g}{_quota_text(tenant.quotas)}"
    if outputs is not None:   # asked about: its outputs quota and what it uses of it
        limit = (settings.tenant_outputs_max_bytes if outputs.max_bytes is None
                 else outputs.max_bytes)
        shown.update(outputs_max_bytes=limit, outputs_bytes=outputs.used_bytes,
                     outputs_max_is_default=outputs.max_bytes is None)
        text += (f", outputs {outputs.used_bytes} of {limit} bytes"
                 f"{' (the default)' if outputs.max_bytes is None else ''}")
    if as_json:
        print_json(shown)
    else:
        out.print(text)


def _migrated_repo(settings: Settings) -> Repo:
    """The store, its schema first brought to the newest revision (a fresh home works)."""
    from e31 import wiring
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
