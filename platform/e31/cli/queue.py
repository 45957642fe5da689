"""`e31 queue` and `e31 usage`: the pool's queues as the scheduler sees them, and what each
tenant's jobs used of it.

Clients of the HTTP API (`GET /v1/queue`, `GET /v1/usage`, through `e31.cli.common`).
Owns: the two commands and how they print. May import: `e31.cli.common`, `e31.cli.common`,
the `e31` core and `e31.client` (lazily, through `common.client`).
"""

from __future__ import annotations

from typing import Any

import typer
from rich.table import Table

from e31.cli.common import JsonOpt, api_client, call, err, out, print_json, slots_text

app = typer.Typer()


@app.command()
def usage(all_tenants: bool = typer.Option(False, "--all-tenants",
                                           help="every tenant (admin token)"),
          only_batches: bool = typer.Option(False, "--batches", help="only the newest batches "
                                            "of requests: tokens in and out, GPU-seconds"),
          as_json: bool = JsonOpt) -> None:
    """Jobs by state, GPU-seconds billed and time queued (never billed), per tenant and class;
    then the newest batches' requests, tokens and GPU-seconds."""
    report = call(api_client().usage_report, all_tenants=all_tenants)   # one request
    batches = report.get("batches", [])
    if only_batches and as_json:
        print_json(batches)
        return
    rows = [] if only_batches else report["usage"]
    if as_json:
        print_json(rows)
        return
    if not only_batches:
        table = Table("tenant", "class", "jobs", "gpu-seconds", "run s", "queued s")
        for r in rows:
            jobs = ", ".join(f"{k} {v}" for k, v in sorted(r["jobs"].items()))
            table.add_row(r["tenant"], r["size_class"], jobs, f"{r['gpu_seconds']:.1f}",
                          f"{r['run_seconds']:.1f}", f"{r['queued_seconds']:.1f}")
        out.print(table)
    if batches or only_batches:
        out.print(_batches_table(batches))


def _batches_table(batches: list[dict[str, Any]]) -> Table:
    """The newest batches of requests, a row each: what `--batches` prints (it printed nothing
    in text before: the rows were read and never shown)."""
    table = Table("batch", "tenant", "status", "requests", "completed", "failed",
                  "tokens in", "tokens out", "gpu-seconds")
    for b in batches:
        table.add_row(b["batch"], b["tenant"], b["status"], str(b["requests"]),
                      str(b["completed"]), str(b["failed"]), str(b["prompt_tokens"]),
                      str(b["completion_tokens"]), f"{b['gpu_seconds']:.1f}")
    return table


@app.command()
def queue(as_json: bool = JsonOpt) -> None:
    """Each size class: its slots (GPUs, or a CPU class's workers), busy slots, and per
    tenant the queued jobs, slots running (GPUs, or a CPU class's jobs) and share of them
    against share of weight (other tenants merged unless your token is admin)."""
    view = call(api_client().queue)
    if as_json:
        print_json(view)
        return
    unread = view.get("broker") == "unreachable"   # the heartbeats could not be read
    if unread:
        err.print("the broker (Redis) is unreachable: the pool's GPUs are unknown (shown ?), "
                  "and nothing is published until it is back", highlight=False)
    table = Table("class", "slots", "busy", "queued", "tenant", "queued", "running",
                  "used share", "weight share", "quota")
    for c in view["classes"]:   # slots: the class's GPUs, or its CPU workers' (one each)
        first = True
        for t in c["tenants"] or [None]:
            gpus, busy = ("?", "?") if unread else (slots_text(c), str(c["busy_gpus"]))
            head = [c["size_class"], gpus, busy, str(c["queued"])] if first else ["", "", "", ""]
            first = False
            if t is None:
                table.add_row(*head, "-", "", "", "", "", "")
                continue
            # running: the slots its jobs hold (GPUs, or a CPU class's jobs); an API older
            # than the field counted GPUs only
            table.add_row(*head, t["tenant"], str(t["queued"]),
                          str(t.get("running", t["running_gpus"])),
                          f"{t['used_share']:.0%}", f"{t['weight_share']:.0%}",
                          "-" if t["quota"] is None else str(t["quota"]))
    out.print(table)
    isolation = [f"{c['size_class']} {'/'.join(c['isolation'])}" for c in view["classes"]
                 if c.get("isolation")]
    if isolation:   # how each class's workers keep jobs apart (docs/security.md)
        out.print("isolation: " + ", ".join(isolation), highlight=False)
    network = [f"{c['size_class']} {'/'.join(c['network'])}" for c in view["classes"]
               if c.get("network")]
    if network:     # each class's jobs' network (docs/security.md, "A job's own network")
        out.print("network: " + ", ".join(network), highlight=False)
    shared = [c["size_class"] for c in view["classes"] if "host" in c.get("network", ())]
    if shared:
        err.print(f"warning: jobs of {', '.join(shared)} share their worker's network "
                  "(job_network = host, or isolation process): they reach the host's loopback "
                  "and the pool's own services (docs/security.md)")
    if view.get("tenants"):
        standing = Table("tenant", "weight", "decayed GPU-s", "usage share", "weight share")
        for t in view["tenants"]:
            standing.add_row(t["tenant"], f"{t['weight']:g}", f"{t['usage_gpu_s']:.0f}",
                             f"{t['usage_share']:.0%}", f"{t['weight_share']:.0%}")
        out.print(standing)
    for d in view.get("drained") or []:   # nodes out of service, and why
        out.print(f"out of service: {d['node']} since {d['since'][:19]}: {d['reason']}")
