"""The process layer of a GPU node: the launcher (one Celery process per GPU slot), the
Celery process itself, the heartbeat and drain.

May import: the `e31` core and store, and the layers below it (`e31_worker.attempt`).
"""
