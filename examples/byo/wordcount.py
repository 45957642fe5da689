"""A job that brings its own code and data: `e31 submit job.yaml` (docs/jobs.md,
"Bring your code, environment and data").

It counts the words of `data/words.txt`, a file of its own bundle (the job starts in its code,
so a relative path finds it), and of the input `extra`, staged into `ctx.input_dir`.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from textstats import top_words


def main(ctx: Any, top: int = 3) -> dict[str, Any]:
    own = Path("data/words.txt").read_text().split()
    extra = (ctx.input_dir / "extra").read_text().split()
    counts = Counter(own) + Counter(extra)
    result = {"words": sum(counts.values()), "top": top_words(counts, top)}
    (ctx.output_dir / "counts.json").write_text(json.dumps(counts, sort_keys=True))
    return result
