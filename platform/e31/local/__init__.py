"""The embedded stack on one machine: `e31 up`/`down`, its private Redis, the profile it
writes, and `e31 demo`.

May import: everything in `e31`; it starts `e31_worker` as processes and imports it only
lazily (GPU discovery, the demo's data).
"""
