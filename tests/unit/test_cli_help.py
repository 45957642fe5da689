"""The CLI's help is plain text: what it says in brackets (the environment variable) shows."""

from __future__ import annotations

from e31.cli import app
from typer.testing import CliRunner


def test_an_options_help_names_its_environment_variable_in_brackets() -> None:
    result = CliRunner().invoke(app, ["api", "--help"])

    assert result.exit_code == 0
    assert "[env E31_API_HOST]" in result.output
