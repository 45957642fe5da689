"""`e31 gc`: remove the artifacts of jobs that ended longer ago than the retention.

Owns: the `gc` command and how it prints. The policy itself is `e31.ops.retention.collect`.
A dry run is the default; only `--delete` removes anything.
May import: `e31.cli.common`, the `e31` core and store (lazily, inside the command).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from e31.cli.common import EXIT_INPUT, HomeOpt, JsonOpt, fail, load_settings, out, print_json

if TYPE_CHECKING:
    from e31.ops.retention import GcReport

app = typer.Typer()


@app.command()
def gc(older_than: float | None = typer.Option(
           None, "--older-than", metavar="DAYS",
           help="remove the artifacts of jobs that ended more than DAYS ago (more than 0; "
                "0.001 is 86 s) [default: the setting artifact_retention_days, env "
                "E31_ARTIFACT_RETENTION_DAYS, whose 0 keeps all]"),
       delete: bool = typer.Option(False, "--delete/--dry-run",
                                   help="remove them (the default is a dry run that only lists)"),
       home: Path | None = HomeOpt, as_json: bool = JsonOpt) -> None:
    """Remove outputs, logs and checkpoints of old jobs; the jobs' rows and status stay."""
    from e31.core.clock import utcnow
    from e31.edge import wiring
    from e31.ops.retention import collect
    from e31.store.migrate import upgrade
    if older_than is not None and older_than <= 0:
        # 0 is the setting's "keep forever"; as a flag a user means "every ended job": refused
        # rather than read either way (issue 32), naming the flag that does the latter.
        fail(f"--older-than {older_than:g}: must be a number of days above 0; --older-than "
             "0.001 takes every job that ended more than 86 s ago "
             "(artifact_retention_days = 0, the setting, keeps artifacts forever)", EXIT_INPUT)
    settings = load_settings(home=home)
    days = settings.artifact_retention_days if older_than is None else older_than
    if days < 0:
        fail(f"artifact_retention_days {days:g}: must be a number of days >= 0", EXIT_INPUT)
    repo = wiring.repo(settings)
    upgrade(repo.engine)
    report = collect(repo, wiring.artifacts(settings), older_than_days=days, now=utcnow(),
                     delete=delete)
    if as_json:
        print_json(report.to_dict())
        return
    out.print(_summary(report), highlight=False)


def _summary(report: GcReport) -> str:
    """One line: what was (or would be) removed, and how to delete after a dry run."""
    if report.cutoff is None:
        return "retention 0 days: artifacts are kept forever; nothing to remove"
    verb = "removed" if report.deleted else "would remove"
    line = (f"{verb} the artifacts of {len(report.jobs)} jobs that ended before "
            f"{report.cutoff.isoformat(timespec='seconds')}: {report.files} files, "
            f"{_size(report.bytes)}")
    if not report.deleted and report.jobs:
        line += "\n(dry run: nothing was removed; run again with --delete to remove them)"
    return line


def _size(n: int) -> str:
    """Bytes as a person reads them, with the exact count: `1.5 GiB (1610612736 bytes)`."""
    value, unit = float(n), "bytes"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{n} bytes" if unit == "bytes" else f"{value:.1f} {unit} ({n} bytes)"
