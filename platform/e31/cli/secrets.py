"""`e31 secret set NAME` (the value on stdin), `e31 secret list [--json]`, `e31 secret delete NAME`.

Owns: the `secret` group and how it prints. The secrets live behind `/v1/secrets` (docs/security.md,
"Secrets"); a value is read from stdin only, never from an argument (which `ps` and the shell's
history would show), and never printed.
May import: `e31.cli.common`, `e31.core.errors`, the client (lazily, inside the commands).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import typer

from e31.cli.common import EXIT_INPUT, JsonOpt, api_client, exit_code, fail, out, print_json
from e31.core.errors import ClientError

app = typer.Typer(help="A tenant's secrets: given to the jobs that name them (secrets: [NAME]) "
                       "as environment variables; stored encrypted, never shown.",
                  no_args_is_help=True)
NameArg = typer.Argument(..., metavar="NAME", help="an environment variable's name (HF_TOKEN)")


def _call(fn: Callable[..., Any], *args: Any) -> Any:
    client = api_client()
    try:
        return fn(client, *args)
    except ClientError as exc:
        fail(exc.message, exit_code(exc))


@app.command("set")
def set_secret(name: str = NameArg) -> None:
    """Set NAME to the value read from stdin (one trailing newline dropped): printf %s "$TOKEN" |
    e31 secret set HF_TOKEN."""
    if sys.stdin.isatty():
        out.print("value (then Enter, Ctrl-D):", highlight=False)
    value = sys.stdin.read()
    value = value[:-1] if value.endswith("\n") else value
    value = value[:-1] if value.endswith("\r") else value
    if not value:
        fail("no value on stdin: printf %s VALUE | e31 secret set NAME", EXIT_INPUT)
    info = _call(lambda c, n, v: c.set_secret(n, v), name, value)
    out.print(f"secret {info['name']} set", highlight=False)


@app.command("list")
def list_secrets(as_json: bool = JsonOpt) -> None:
    """The tenant's secrets: names and dates, never values."""
    rows = _call(lambda c: c.list_secrets())
    if as_json:
        print_json(rows)
        return
    if not rows:
        out.print("no secrets (e31 secret set NAME)", highlight=False)
        return
    out.print(f"{'NAME':<32} {'CREATED':<26} UPDATED", highlight=False)
    for r in rows:
        out.print(f"{r['name']:<32} {r['created_at'][:19]:<26} {r['updated_at'][:19]}",
                  highlight=False)


@app.command("delete")
def delete_secret(name: str = NameArg) -> None:
    """Delete NAME; a queued job that names it fails at its start (reason setup)."""
    _call(lambda c, n: c.delete_secret(n), name)
    out.print(f"secret {name} deleted", highlight=False)
