"""A job that brings its own environment: `e31 submit job-env.yaml` (docs/jobs.md, "Bring your
code, environment and data").

It needs `tomli_w`, a package the workers lack: `requirements.txt` of this directory asks for
it, and the worker builds the job an environment with it before the job starts. It counts the
words of `data/words.txt`, stores them as `counts.toml` in `ctx.output_dir`, and returns them.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import tomli_w


def main(ctx: Any) -> dict[str, int]:
    counts = dict(sorted(Counter(Path("data/words.txt").read_text().split()).items()))
    (ctx.output_dir / "counts.toml").write_text(tomli_w.dumps({"counts": counts}))
    return counts
