"""What `e31 token`, `e31 tenant` and `e31 audit` share when they talk to an API: the options
that name it, the tenancy client, a call that turns an error answer into a message and an
exit code, and durations such as `30d`.

Owns: `UrlOpt`, `TokenOpt`, `tenancy`, `call`, `parse_duration`, `token_expiry`.
May import: `e31.cli.common`, the `e31` core, and `e31.client` (lazily). No group imports
another; these groups import this module.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import typer

from e31.cli.common import EXIT_INPUT, api_client, exit_code, fail
from e31.core.errors import ClientError

if TYPE_CHECKING:
    from e31.client.admin import Tenancy

T = TypeVar("T")
UNITS_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION = re.compile(r"^([0-9]{1,9})([smhdw])$")

UrlOpt = typer.Option(None, "--url", envvar="E31_URL", help="manage through this API (with an "
                      "admin's --token) instead of the store of this machine [env E31_URL]")
TokenOpt = typer.Option(None, "--token", envvar="E31_TOKEN",
                        help="the admin token for --url [env E31_TOKEN]")


def tenancy(url: str | None = None, token: str | None = None) -> Tenancy:
    """The tenancy client of the API named by `url`/`token`, else E31_URL/E31_TOKEN, else the
    profile `e31 up` wrote (exit 2 when none is known: the user's setup)."""
    from e31.client.admin import Tenancy
    return Tenancy(api_client(url, token))


def call(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run a client call; a refusal (a 401 among them) exits 2 with the API's message,
    anything else 3."""
    try:
        return fn(*args, **kwargs)
    except ClientError as exc:
        fail(exc.message, exit_code(exc))


def parse_duration(text: str, option: str) -> int:
    """`90s`, `15m`, `12h`, `30d`, `2w` as seconds (exit 2 otherwise)."""
    m = _DURATION.fullmatch(text.strip())
    if not m or int(m.group(1)) == 0:
        fail(f"{option} {text!r}: expected a positive number and a unit s, m, h, d or w "
             "(e.g. 30d)", EXIT_INPUT)
    return int(m.group(1)) * UNITS_S[m.group(2)]


def token_expiry(expires_in: str | None, expires_at: str | None) -> dict[str, Any]:
    """A token's expiry as the API's fields: `--expires-in` as `expires_in_s`, `--expires-at`
    as `expires_at`, sent as given (the API checks it and stores that very instant; turned
    into seconds here, it would move by the time the request took). One of them at most."""
    if expires_in and expires_at:
        fail("give --expires-in or --expires-at, not both", EXIT_INPUT)
    if expires_in:
        return {"expires_in_s": parse_duration(expires_in, "--expires-in")}
    return {"expires_at": expires_at} if expires_at else {}
