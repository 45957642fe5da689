"""Which isolation a worker takes when it starts: the sandbox where the host can give one,
else `e31 worker` refuses to start saying why, and `e31 up` falls back to `process` with a
warning unless `--isolation sandbox` was asked for. Here the host's bubblewrap is hidden
(PATH without it), which every host can do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from e31.cli.stack import _isolation
from e31.edge.settings import Settings


def no_bwrap_path(tmp_path: Path) -> str:
    """A PATH with this Python and nothing else: no `bwrap` on it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    return str(bin_dir)


def test_a_worker_that_cannot_set_up_the_sandbox_refuses_to_start_and_says_why(
        tmp_path: Path) -> None:
    # Given a host without bubblewrap
    env = {k: v for k, v in os.environ.items() if not k.startswith("E31_")}
    env.update(PATH=no_bwrap_path(tmp_path), E31_HOME=str(tmp_path / "home"),
               E31_REDIS_URL="redis://127.0.0.1:9/0")

    # When `e31 worker` starts with the default isolation
    done = subprocess.run([sys.executable, "-m", "e31.cli", "worker", "--cpu-slots", "1"],
                          env=env, capture_output=True, text=True, timeout=60)

    # Then it stops at once, exit 2, saying why and what to do instead
    said = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 2, said
    assert "cannot run jobs in a sandbox on this host" in said
    assert "bubblewrap is not installed" in said and "--isolation process" in said


def test_e31_up_falls_back_to_process_with_a_warning_unless_the_sandbox_was_asked_for(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # Given a host without bubblewrap
    monkeypatch.setenv("PATH", no_bwrap_path(tmp_path))
    settings = Settings.load({"home": str(tmp_path / "home")}, environ={})

    # When `e31 up` chooses without a flag, then with --isolation sandbox
    chosen = _isolation(settings, chosen=False)
    warned = capsys.readouterr().err
    with pytest.raises(typer.Exit) as refused:
        _isolation(settings, chosen=True)

    # Then it runs jobs as the user, saying so, or refuses when the sandbox was asked for
    assert chosen == "process"
    assert "warning: jobs run without a sandbox" in warned and "bubblewrap" in warned
    assert refused.value.exit_code == 2
    assert "cannot run jobs in a sandbox" in capsys.readouterr().err
    assert _isolation(Settings.load({"home": str(tmp_path / "home"),
                                     "isolation": "process"}, environ={}),
                      chosen=True) == "process"
