"""E31 Batch data plane: GPU-pinned workers that run jobs (needs torch only inside jobs).

Three layers, each importing only the ones below it (and the `e31` core and store):
`node` (launcher, Celery process, heartbeat, GPUs) → `attempt` (claim → prepare → run →
ship → record) → `child` (runner, `JobContext`). `workloads` and `examples` are job code
beside `child`. See docs/architecture.md.
"""
