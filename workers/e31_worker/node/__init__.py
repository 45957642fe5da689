"""The process layer of a GPU node: the launcher (one Celery process per GPU slot), the
Celery process itself, its heartbeat and drain, and GPU discovery.

May import: the `e31` core and store, and the layers below it (`e31_worker.attempt`, and
through it `e31_worker.child`'s file contract). Nothing below imports this layer: the
attempt layer gets what it needs from here as an `AttemptServices`.
"""
