"""The claim each attempt keeps in its directory (`CLAIM_FILE`), and finding those a node left
(`left_claims`): what a restarted worker settles (`settle`) and what a launcher reads when
its worker dies (`e31_worker.node.release`). A module of its own, with no Celery or store
import, so that the launcher does not load the attempt machinery it never runs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CLAIM_FILE = "claim.json"   # in the attempt's directory: what a restarted worker needs


def left_claims(work_dir: Path, node: str) -> Iterator[tuple[Path, dict[str, Any]]]:
    """Each attempt directory of `node` under `work_dir` that still holds its claim, with the
    claim's data (its "node" taken out); another node's, alive or not, is its own successor's."""
    for claim_file in sorted(work_dir.glob(f"*/attempt-*/{CLAIM_FILE}")):
        try:
            data = json.loads(claim_file.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.pop("node", None) == node:
            yield claim_file.parent, data
