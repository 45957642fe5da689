"""How committed JSONL segments are named: the layout a resumable workload writes under its
job's checkpoints (`e31_worker.workloads.segments.SegmentWriter`) and the API reads back to
finalise a batch whose shards did not finish (`e31.api.services.batchends`).

A segment covers the input records `[start, end)` and is two files, `<start>-<end>.errors.jsonl`
then `<start>-<end>.results.jsonl`, renamed into place in that order: a results file means its
segment is whole.
"""

from __future__ import annotations

import re

KINDS = ("errors", "results")             # commit order: results last marks a whole segment
WHOLE = re.compile(r"^(\d{12})-(\d{12})\.results\.jsonl$")   # a whole segment's results file


def segment_name(start: int, end: int, kind: str) -> str:
    """The file of `kind` of the segment of records `[start, end)`."""
    return f"{start:012d}-{end:012d}.{kind}.jsonl"
