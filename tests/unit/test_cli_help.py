"""The `e31` command's shape: plain-text help, every group's commands in one listing, and a
CLI package whose group modules stay apart and load nothing heavy until a command runs."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

import e31.cli
from e31.cli import app

CLI_DIR = Path(e31.cli.__file__).parent

# What `e31 --help` lists, in this order: the job verbs, top, the demo, the services, the
# local stack, gc, then the two sub-groups.
TOP_LEVEL = ["submit", "status", "ls", "logs", "result", "cancel", "wait", "usage", "queue",
             "retry", "top", "demo", "worker", "api", "scheduler", "flower", "up", "down", "gc",
             "audit", "db", "tenant", "token", "secret", "batch", "model"]


def test_an_options_help_names_its_environment_variable_in_brackets() -> None:
    result = CliRunner().invoke(app, ["api", "--help"])

    assert result.exit_code == 0
    assert "[env E31_API_HOST]" in result.output


def test_the_top_level_help_lists_every_groups_commands_once_in_order() -> None:
    # When the top-level help is printed
    result = CliRunner().invoke(app, ["--help"])

    # Then each command appears once, in the order of the groups
    assert result.exit_code == 0
    # (the listing ends at its first blank line: the epilog's paragraphs follow)
    listing = result.output.split("Commands:", 1)[1].strip("\n").split("\n\n", 1)[0].splitlines()
    names = [line.split()[0] for line in listing if line.startswith("  ") and line.strip()]
    assert names == TOP_LEVEL


def test_the_sub_groups_list_their_commands() -> None:
    assert "upgrade" in CliRunner().invoke(app, ["db", "--help"]).output
    tenant_help = CliRunner().invoke(app, ["tenant", "--help"]).output
    assert "create" in tenant_help and "update" in tenant_help


def test_no_command_group_module_imports_another() -> None:
    # Given every module of the CLI package but the root that assembles them
    for path in sorted(CLI_DIR.glob("*.py")):
        if path.name in ("__init__.py", "__main__.py"):
            continue
        # When its imports of the CLI package are read
        tree = ast.parse(path.read_text())
        imported = {node.module for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom) and node.module
                    and (node.module == "e31.cli" or node.module.startswith("e31.cli."))}
        # Then it imports at most the shared pieces (common; remote, what the groups that talk
        # to the admin API share), and common imports no CLI module, remote only common
        allowed = set() if path.name == "common.py" else \
            {"e31.cli.common"} if path.name == "remote.py" else {"e31.cli.common", "e31.cli.remote"}
        assert imported <= allowed, f"{path.name} imports {sorted(imported - allowed)}"


def test_loading_the_cli_imports_neither_the_worker_nor_the_store() -> None:
    # Given a fresh interpreter (so that nothing else has loaded them already)
    probe = ("import sys, e31.cli; heavy = ('e31_worker', 'e31.store', 'e31.edge.wiring', "
             "'e31.client', 'e31.local', 'sqlalchemy', 'celery', 'redis', 'uvicorn', 'fastapi'); "
             "print(','.join(m for m in heavy if m in sys.modules))")

    # When it imports the CLI, as `e31 --help` does
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60)

    # Then the heavy modules stay unloaded: the commands import them when they run
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""
