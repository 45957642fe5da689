"""Which of the caller's modules travel with a function (`e31.functions.modules.needs_of`):
the local ones it reaches, at the paths their names give; installed ones by distribution."""

from __future__ import annotations

import importlib
import json
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
    assert "pytest" in needs.modules["pytest"]   # its modules, for a refusal to name


def test_the_pools_own_packages_and_the_standard_library_never_travel() -> None:
    from e31.functions import modules
    needs = needs_of(modules.needs_of)
    assert not any(p.startswith(("e31/", "json")) for p in needs.files)


def test_a_module_made_in_memory_is_named_as_one_the_worker_cannot_import() -> None:
    import types
    made = types.ModuleType("made_here")
    made.VALUE = 3   # type: ignore[attr-defined]
    sys.modules["made_here"] = made
    try:
        namespace: dict[str, object] = {"made_here": made, "__name__": "made_user"}
        exec("def use():\n    return made_here.VALUE\n", namespace)
        user = types.ModuleType("made_user")
        user.__dict__.update(namespace)
        sys.modules["made_user"] = user
        assert needs_of(namespace["use"]).fileless == frozenset({"made_here", "made_user"})
    finally:
        sys.modules.pop("made_here", None)
        sys.modules.pop("made_user", None)


def test_a_main_function_needs_only_what_it_names_not_all_of_the_notebooks_namespace(
        project: Path) -> None:
    # Given a function of __main__ (a script, a notebook) whose namespace holds more than it
    # uses: pytest, as a notebook holds IPython
    util = importlib.import_module("proj_util")
    namespace: dict[str, object] = {"__name__": "__main__", "proj_util": util, "pytest": pytest}
    exec("def score(x):\n    return [proj_util.double(v) for v in range(x)]\n", namespace)
    # Then only the module it names travels, and no installed package is asked of the worker
    needs = needs_of(namespace["score"])
    assert sorted(needs.files) == ["proj_util.py"]
    assert needs.distributions == frozenset()


def test_an_installed_module_no_distribution_provides_is_named_as_unpackaged(
        tmp_path: Path) -> None:
    # Given a bare module in a directory named as an interpreter's own (so it counts as
    # installed, not as the caller's to send) with no package metadata beside it
    site = tmp_path / "site-packages"
    site.mkdir()
    (site / "bare_unpackaged.py").write_text("VALUE = 1\n\ndef work():\n    return VALUE\n")
    sys.path.insert(0, str(site))
    try:
        bare = importlib.import_module("bare_unpackaged")
        namespace: dict[str, object] = {"__name__": "__main__", "bare_unpackaged": bare,
                                        "pytest": pytest, "json": json}
        exec("def use():\n    return bare_unpackaged.VALUE, pytest, json\n", namespace)
        # When what the function needs is read
        needs = needs_of(namespace["use"])
        own = needs_of(bare.work)    # a function of the bare module itself
    finally:
        sys.path.remove(str(site))
        sys.modules.pop("bare_unpackaged", None)
    # Then the bare module is named for the workers to have, and does not travel; a module
    # of a distribution (pytest) and the standard library's (json) are not named so
    assert needs.unpackaged == frozenset({"bare_unpackaged"})
    assert needs.files == {}
    assert needs.distributions == frozenset({"pytest"})
    assert own.unpackaged == frozenset({"bare_unpackaged"}) and own.files == {}
