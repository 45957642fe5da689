"""The README's promises that a test can keep: CI runs exactly its test command."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[2]


def _bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL)]


def test_ci_runs_exactly_the_readmes_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    test_command = next(b for b in _bash_blocks(readme) if "pytest" in b)
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_command in ci_lines


def test_ci_fails_loudly() -> None:
    assert "set -euo pipefail" in (ROOT / ".ci" / "run").read_text()


def test_the_readme_installs_the_cpu_torch_before_the_project() -> None:
    for block in _bash_blocks((ROOT / "README.md").read_text())[:2]:
        assert block.index("torch==2.13.0") < block.index("pip install -q -e" if " -q -e" in block
                                                           else "pip install -e")
