"""The attempt layer: claim → the stages → record, for one delivered job.

`task` (the Celery task: the claim, then a loop over the stages), `stages` (`Stage`, whose
hooks list every stage of an attempt, and `Attempt`, what its stages share), the stages each
in its own module (`workspace`, `secrets`, `bundle`: the code, `inputs`, `environment`,
`shipping`, `watchdog`: the lease and idleness, `isolation`: the child's sandbox, cgroups,
limits and start), `supervisor` (the child process, started by `start`, its log by
`logpump`, its end by `outcomes`), `record` (the fenced outcome, the claim file), `settle`
(what a dead predecessor left), `services` (what the process layer hands in).

May import: the `e31` core and store, and the child side's file contract (the argv of
`e31_worker.child.runner` and the result files it writes). Never the node layer.
"""
