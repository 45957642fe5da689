"""A module of the bundle that `wordcount` imports: the bundle is first on PYTHONPATH."""

from __future__ import annotations

from collections import Counter


def top_words(counts: Counter[str], n: int) -> list[list[object]]:
    """The `n` most common words with their counts, ties in alphabetical order."""
    return [[w, c] for w, c in sorted(counts.items(), key=lambda wc: (-wc[1], wc[0]))[:n]]
