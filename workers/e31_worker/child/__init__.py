"""The child side: what runs inside an attempt's process — the runner and `JobContext`.

May import: the `e31` core only (and nothing at all at module level that touches CUDA).
"""
