"""The attempt layer: claim → prepare → run → ship → record, for one delivered job.

May import: the `e31` core and store, and the child side's file contract. Never the node layer.
"""
