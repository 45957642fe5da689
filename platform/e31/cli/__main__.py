"""`python -m e31.cli`: the same as the `e31` command (used to start the stack's processes)."""

from e31.cli import main

main()
