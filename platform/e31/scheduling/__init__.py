"""Scheduling: the leader loop, the inputs it builds, the pure admission decision, fair share
and the pending-reason explanation.

May import: the `e31` core and `e31.store`. Never the API, the client, the CLI or `e31_worker`.
"""
