"""What every bench script's command line shares: `--smoke` (its tiny run) and `--out FILE`.

`--smoke` is the size tests/bench runs in the suite (seconds, against the same real services
as a measurement): it sets the script's own smoke defaults, and a flag given as well still
wins. `--out FILE` writes the script's figures as one JSON object, which the test reads.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

SMOKE_HELP = "a run of seconds, the size the test suite runs (tests/bench); other flags still win"


def parse(ap: argparse.ArgumentParser, smoke: dict[str, Any],
          argv: list[str] | None = None) -> argparse.Namespace:
    """`ap`'s arguments with --smoke (which applies `smoke`, its defaults) and --out."""
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    ap.add_argument("--out", type=Path, default=None, help="also write the figures here (JSON)")
    args = ap.parse_args(argv)
    if args.smoke:
        ap.set_defaults(**smoke)
        args = ap.parse_args(argv)
    return args


def save(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """Write `report` to `--out`, if given (paths and other objects as their text)."""
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
