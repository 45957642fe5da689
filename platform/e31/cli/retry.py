"""`e31 retry A-ID --failed`: run an array's failed and cancelled items again.

Owns: the `retry` command and how it prints. The rule (the same jobs as their next attempt,
and what their failure had cancelled queued again) is the store's: `Repo.retry_array`,
through `POST /v1/arrays/{id}/retry` (docs/jobs.md, "Retry only what failed").
May import: `e31.cli.common`, `e31.core.errors`, the client (lazily, inside the command).
"""

from __future__ import annotations

import typer

from e31.cli.common import (
    EXIT_INPUT,
    JsonOpt,
    api_client,
    exit_code,
    fail,
    out,
    print_json,
)
from e31.core.errors import ClientError

app = typer.Typer()


@app.command()
def retry(array_id: str = typer.Argument(..., metavar="A-ID", help="the array (a-…)"),
          failed: bool = typer.Option(False, "--failed",
                                      help="the failed and cancelled items (required: the only "
                                           "kind of retry there is, said out loud)"),
          as_json: bool = JsonOpt) -> None:
    """Queue an array's failed and cancelled items again, and a merge waiting on it."""
    if not failed:
        fail("say which items: e31 retry A-ID --failed", EXIT_INPUT)
    if not array_id.startswith("a-"):
        fail(f"{array_id}: not an array id (a-…); a single job is resubmitted with e31 submit",
             EXIT_INPUT)
    from e31.client import ArrayHandle
    client = api_client()
    try:
        st = ArrayHandle(client, array_id, job_ids=[]).retry_failed()
    except ClientError as exc:
        fail(exc.message, exit_code(exc))
    if as_json:
        print_json(st)
        return
    out.print(f"{array_id}: {len(st['resubmitted'])} item(s) queued again"
              + (f", {len(st['rearmed'])} waiting job(s) re-armed" if st["rearmed"] else ""),
              highlight=False)
    for job_id in st["resubmitted"] + st["rearmed"]:
        out.print(job_id, highlight=False)
