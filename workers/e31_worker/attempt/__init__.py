"""The attempt layer: claim → prepare → run → ship → record, for one delivered job.

`task` (the Celery task, the stages in order), `supervisor` (the child process),
`lease` (the lease while it runs), `shipping` (log, checkpoints, outputs), `record`
(the fenced outcome, the claim file), `settle` (what a dead predecessor left),
`groups` and `cgroups` (the job's processes), `services` (what the process layer hands in).

May import: the `e31` core and store, and the child side's file contract (the argv of
`e31_worker.child.runner` and the result files it writes). Never the node layer.
"""
