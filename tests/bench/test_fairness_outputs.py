"""`python bench/fairness/sim.py` as docs/scheduling.md says to run it leaves the repository
as it was (issue 32: it rewrote the tracked results.json and plot): its figures go into a new
temporary directory it names, and only `--refresh` writes the tracked files."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRACKED = [ROOT / "bench/fairness/results.json", ROOT / "docs/img/fairness_share.png"]


def _digests() -> list[str]:
    return [hashlib.sha256(p.read_bytes()).hexdigest() for p in TRACKED]


def test_a_plain_run_writes_into_a_temporary_directory_not_the_tracked_files(
        tmp_path: Path) -> None:
    # Given the tracked figures
    before = _digests()
    # When the simulation runs without --json, --png or --refresh (on a small flood)
    ran = subprocess.run([sys.executable, "bench/fairness/sim.py", "--pools", "shared",
                          "--flood-jobs", "200"], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, TMPDIR=str(tmp_path)), timeout=170)
    # Then it wrote its figures into a new directory under TMPDIR, and said where
    wrote = re.search(r"^wrote (\S+/results\.json)$", ran.stdout, re.M)
    assert wrote, ran.stdout + ran.stderr
    written = Path(wrote.group(1))
    assert written.parent.parent == tmp_path and written.parent.name.startswith("e31-fairness-")
    assert '"shared/fair"' in written.read_text()
    # and the plot beside it, or (without matplotlib) said why not
    assert ((written.parent / "fairness_share.png").exists()
            or "the plot needs matplotlib" in ran.stderr), ran.stdout + ran.stderr
    # and the tracked files are as they were
    assert _digests() == before


def test_a_plain_node_simulation_writes_into_a_temporary_directory_not_the_tracked_file(
        tmp_path: Path) -> None:
    # Given the tracked figures
    before = _digests()
    # When the node simulation runs as docs/scheduling.md says, with no --json or --refresh
    # (one short variant of each trace: its time)
    ran = subprocess.run([sys.executable, "bench/fairness/nodesim.py", "--runs", "pack",
                          "--steady-runs", "pack", "--horizon-h", "1", "--scale", "0.05"],
                         cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, TMPDIR=str(tmp_path)), timeout=170)
    # Then it stored its figures under "nodes" in a new directory under TMPDIR, and said where
    # (issue 32: it rewrote the tracked bench/fairness/results.json)
    wrote = re.search(r"^wrote (\S+/results\.json) \(under \"nodes\"\)$", ran.stdout, re.M)
    assert wrote, ran.stdout + ran.stderr
    written = Path(wrote.group(1))
    assert written.parent.parent == tmp_path and written.parent.name.startswith("e31-nodesim-")
    assert '"flood/pack"' in written.read_text()
    # and the tracked files are as they were
    assert _digests() == before
