"""The `e31` command: one module per command group.

May import: everything; `e31_worker` only lazily, inside the commands that need it.
"""

from e31.cli.jobs import app, main

__all__ = ["app", "main"]
