"""`e31 top`: a live view of the pool in the terminal — each class's GPUs (busy, idle,
draining, lost; utilisation and memory), its backlog and oldest wait, each GPU, and the
running jobs with their tenant, runtime and GPU use — refreshed in place every few seconds.
`--once` prints one snapshot; `--once --json` prints it as JSON, for scripts.

A client of `GET /v1/top` (docs/operations.md, "Monitoring"). May import: `e31.cli.common`,
the `e31` core and `e31.client` (lazily, inside the command), typer and rich.
"""

from __future__ import annotations

import time
from typing import Any

import typer
from rich import box
from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from e31.cli.common import (
    EXIT_INTERRUPTED,
    JsonOpt,
    api_client,
    exit_code,
    fail,
    out,
    print_json,
    slots_text,
)
from e31.core.errors import ClientError

PATH = "/v1/top"
REFRESH_DEFAULT_S = 2.0
GIB = 1024 ** 3

app = typer.Typer()


@app.command()
def top(interval_s: float = typer.Option(REFRESH_DEFAULT_S, "--interval", min=0.2,
                                         help="seconds between refreshes"),
        once: bool = typer.Option(False, "--once", help="print one snapshot and exit"),
        as_json: bool = JsonOpt) -> None:
    """A live view of the pool: classes, GPUs, running jobs, backlog (Ctrl-C leaves).
    Your token's jobs by name; other tenants' merged unless your token is admin."""
    client = api_client()

    def fetch() -> dict[str, Any]:
        try:
            return dict(client.request("GET", PATH).json())
        except ClientError as exc:
            fail(exc.message, exit_code(exc))

    if once or as_json:
        snap = fetch()
        if as_json:
            print_json(snap)
        else:
            out.print(render(snap))
        return
    try:
        with Live(render(fetch()), console=out, screen=False, auto_refresh=False) as live:
            while True:
                time.sleep(interval_s)
                live.update(render(fetch()), refresh=True)
    except KeyboardInterrupt:
        raise typer.Exit(EXIT_INTERRUPTED) from None


def render(snap: dict[str, Any]) -> Group:
    """The snapshot as three tables: classes, GPUs, running jobs. A class's slots are its
    GPUs, or its CPU workers (one slot each): `slots` says which, and busy, idle, drain and
    lost count them."""
    classes = _table("classes", "class", "workers", "slots", "busy", "idle", "drain", "lost",
                     "util", "memory", "queued", "running", "waited")
    for c in snap["classes"]:
        classes.add_row(c["size_class"], str(c["workers"]), slots_text(c), str(c["busy_gpus"]),
                        str(c["idle_gpus"]), str(c["draining_gpus"]), str(c["lost_gpus"]),
                        _pct(c["utilization"]),
                        _mem(c["memory_used_bytes"], c["memory_total_bytes"]), str(c["queued"]),
                        str(c["running"]), _age(c["oldest_queued_s"]))
    gpus = _table("GPUs", "node", "GPU", "class", "state", "util", "memory", "temp", "power",
                  "job")
    for g in sorted(snap["gpus"], key=lambda g: (g["node"], g["gpu"])):
        gpus.add_row(g["node"], g["gpu"] + (" sim" if g["simulated"] else ""), g["size_class"],
                     g["state"], _pct(g["utilization"]),
                     _mem(g["memory_used_bytes"], g["memory_total_bytes"]),
                     _unit(g["temperature_celsius"], "C"), _unit(g["power_watts"], "W"),
                     g["job"] or "-")
    jobs = _table("running", "job", "name", "tenant", "class", "GPUs", "node", "runtime",
                  "done", "util", "memory")
    for j in snap["running"]:
        name = j["name"] + (" (idle)" if j.get("idle_since") else "")
        jobs.add_row(j["id"], name, j["tenant"], j["size_class"], str(j["gpus"]),
                     j["node"] or "-", _age(j["runtime_s"]), _pct(j["progress"]),
                     _pct(j["gpu_utilization"]), _mem(j["gpu_memory_used_bytes"], None))
    for o in snap.get("others", []):
        jobs.add_row("-", f"{o['jobs']} jobs", o["tenant"], o["size_class"], str(o["gpus"]),
                     "-", "-", "-", "-", "-")
    parts: list[Any] = [classes, gpus, jobs]
    if not snap.get("workers_known", True):
        parts.insert(0, Text("workers unknown: Redis did not answer", style="yellow"))
    simulated = any(g["simulated"] for g in snap["gpus"])   # said only where one is shown
    parts.append(Text(f"at {snap['at']}" + ("; GPU sim: simulated, its readings made up"
                                            if simulated else ""), style="dim"))
    return Group(*parts)


def _table(title: str, *columns: str) -> Table:
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                  collapse_padding=True)
    for column in columns:
        table.add_column(column, no_wrap=True)
    return table


def _unit(value: float | None, unit: str) -> str:
    return "-" if value is None else f"{value:.0f} {unit}"


def _pct(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.0%}"


def _mem(used: float | None, total: float | None) -> str:
    if used is None:
        return "-"
    return f"{used / GIB:.1f}" + (f"/{total / GIB:.0f}G" if total else "G")


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
