"""The README's promises that a test can keep: CI runs exactly its test command, after the gates."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[2]


def _bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL)]


# The gates .ci/run runs before the tests, as docs/development.md lists them.
GATES = ("ruff check", "mypy", "lint-imports", "vulture")


def _readme_test_command() -> str:
    return next(b for b in _bash_blocks((ROOT / "README.md").read_text()) if "pytest" in b)


def _ci_lines() -> list[str]:
    return [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]


def test_ci_runs_exactly_the_readmes_test_command() -> None:
    assert _readme_test_command() in _ci_lines()


def test_ci_runs_every_gate_in_the_readmes_venv_before_the_tests() -> None:
    # Given the README's test command, and its install half (everything before pytest)
    test_command = _readme_test_command()
    install = test_command[: test_command.index(" && python -m pytest")]
    # When .ci/run is read line by line
    lines = _ci_lines()
    # Then it installs as the README does, runs each gate, and only then the test command
    installed_at = lines.index(install)
    tests_at = lines.index(test_command)
    gate_lines = [(i, line) for i, line in enumerate(lines) if line.startswith("gate ")]
    for tool in GATES:
        gate_at = next(i for i, line in gate_lines if tool in line)
        assert installed_at < gate_at < tests_at, tool


def test_ci_fails_loudly() -> None:
    assert "set -euo pipefail" in (ROOT / ".ci" / "run").read_text()


def test_the_readme_installs_the_cpu_torch_before_the_project() -> None:
    for block in _bash_blocks((ROOT / "README.md").read_text())[:2]:
        assert block.index("torch==2.13.0") < block.index("pip install -q -e" if " -q -e" in block
                                                           else "pip install -e")
