"""The child side: what runs inside an attempt's process — the runner and `JobContext`.

`runner` is the child's entry (`python -m e31_worker.child.runner JOB_JSON`); `context` is
the `ctx` a job's code receives. `e31_worker.workloads` and `e31_worker.examples` sit
beside it and may import it.

May import: the `e31` core only (and nothing at all at module level that touches CUDA).
Never the attempt or node layers.
"""
