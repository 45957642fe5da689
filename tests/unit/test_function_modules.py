"""Which of the caller's modules travel with a function (`e31.functions.modules.needs_of`):
the local ones it reaches, at the paths their names give; installed ones by distribution."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from e31.functions.modules import needs_of


@pytest.fixture
def project(tmp_path: Path) -> Iterator[Path]:
    """A project on sys.path: a package with a submodule that imports a sibling module, and
    a module nothing imports."""
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "__init__.py").write_text("")
    (tmp_path / "proj" / "jobs.py").write_text(
        "import pytest\nfrom proj_util import double\n\ndef run(x):\n    return double(x)\n")
    (tmp_path / "proj_util.py").write_text("def double(x):\n    return 2 * x\n")
    (tmp_path / "unrelated.py").write_text("X = 1\n")
    sys.path.insert(0, str(tmp_path))
    try:
        yield tmp_path
    finally:
        sys.path.remove(str(tmp_path))
        for name in ("proj", "proj.jobs", "proj_util", "unrelated"):
            sys.modules.pop(name, None)


def test_a_modules_function_takes_its_module_its_package_and_the_local_modules_it_imports(
        project: Path) -> None:
    importlib.import_module("unrelated")
    run = importlib.import_module("proj.jobs").run
    needs = needs_of(run)
    assert sorted(needs.files) == ["proj/__init__.py", "proj/jobs.py", "proj_util.py"]
    assert needs.files["proj_util.py"] == (project / "proj_util.py").resolve()
    assert "pytest" in needs.distributions


def test_the_pools_own_packages_and_the_standard_library_never_travel() -> None:
    from e31.functions import modules
    needs = needs_of(modules.needs_of)
    assert not any(p.startswith(("e31/", "json")) for p in needs.files)
