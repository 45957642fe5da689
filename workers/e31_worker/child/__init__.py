"""The child side: what runs inside an attempt's process — the runner and `JobContext`.

`runner` is the child's entry (`python -m e31_worker.child.runner JOB_JSON`); `context` is
the `ctx` a job's code receives. The warm start forks that child from `zygote` (the server
of fork requests), through `warmouter` (its outer and init processes, `warmroot` the
sandbox's root) to `warmjob` (the job process), with `linuxcalls` for what `os` lacks; `netns`
gives a job its own network. `e31_worker.workloads` and `e31_worker.examples` sit beside it
and may import it.

May import: the `e31` core only (and nothing at all at module level that touches CUDA).
Never the attempt or node layers.
"""
