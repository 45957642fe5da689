"""Which modules a function needs: the caller's own, which travel as its code bundle, and the
installed ones, whose versions the worker compares with its own.

Starting from what the function uses (its closure's values and the globals its code names)
and, for a function of an importable module, from that module, every module reached is
followed, and so on from those: a module whose file lies outside the interpreter's own
directories (the standard library, site-packages) is **local**, one of the caller's project,
and its file goes into the bundle at the path its name gives (`pkg/sub/mod.py`, with the
`__init__.py` of each package above it); an installed one is named by its distribution
(`numpy`), for the version check, or, when no distribution provides it (a bare `foo.py` in
site-packages: no package metadata), by its top-level name, which the workers must list as
importable. `e31` and `e31_worker` are the pool's own and never travel.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import site
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

POOL_PACKAGES = frozenset({"e31", "e31_worker"})   # on every worker already, as its own
SKIPPED_TOP = frozenset({"__main__", "builtins", "__mp_main__"})


@dataclass(frozen=True)
class Needs:
    """The local modules' files (bundle path -> file), the installed distributions, and the
    installed top-level modules no distribution provides."""

    files: dict[str, Path]
    distributions: frozenset[str]
    fileless: frozenset[str] = frozenset()   # modules made in memory: no worker can import them
    # distribution -> the top-level modules of it the function reaches, named beside the
    # package when a version check refuses the call (PyYAML: yaml)
    modules: dict[str, frozenset[str]] = field(default_factory=dict)
    # installed top-level modules of no distribution (`unpackaged.py` put in site-packages, a
    # directory of the interpreter's own on PYTHONPATH): no version to compare, so the call is
    # checked against the names of the modules the workers can import
    unpackaged: frozenset[str] = frozenset()


def needs_of(fn: Any) -> Needs:
    """What `fn` needs of the caller's modules: see the module's docstring. The walk starts
    from what the function uses (its closure, and the globals it names) and, unless it is
    `__main__`'s (which travels by value, with only the globals it names), its module."""
    start = sys.modules.get(getattr(fn, "__module__", None) or "__main__")
    if start is not None and start.__name__ in SKIPPED_TOP:
        start = None
    installed = _installed_roots()
    files: dict[str, Path] = {}
    tops: set[str] = set()
    fileless: set[str] = set()
    seen: set[str] = set()
    names = list(_uses(fn, set()))
    todo = [start] if start is not None else []
    while names or todo:
        if not names:
            names = list(_referenced(todo.pop()))
        name = names.pop()
        if name in seen:
            continue
        seen.add(name)
        found = sys.modules.get(name)
        top = name.partition(".")[0]
        if found is None or top in POOL_PACKAGES or top in SKIPPED_TOP:
            continue
        path = _file_of(found)
        if path is None and _made_in_memory(found):
            fileless.add(name)
        elif path is None or _beneath(path, installed):
            tops.add(top)
        else:
            files.update(_bundle_paths(name, path))
            todo.append(found)
    if start is not None and start.__name__.partition(".")[0] not in POOL_PACKAGES:
        path = _file_of(start)
        if path is not None and not _beneath(path, installed):
            files.update(_bundle_paths(start.__name__, path))
        elif path is not None:   # an installed module's function: the worker imports it too
            tops.add(start.__name__.partition(".")[0])
    provides = _distributions(tops)
    packaged = {top for provided in provides.values() for top in provided}
    unpackaged = {top for top in tops - packaged if _installed_file(top, installed)}
    return Needs(files=files, distributions=frozenset(provides), fileless=frozenset(fileless),
                 modules=provides, unpackaged=frozenset(unpackaged))


def _installed_file(top: str, installed: list[str]) -> bool:
    """Whether top-level module `top` is a file (or a package's `__init__.py`) beneath the
    interpreter's directories and not the standard library's: a built-in module has no file,
    and a namespace package neither, which a worker may hold in portions no list names."""
    if top in sys.stdlib_module_names or top in sys.builtin_module_names:
        return False
    path = _file_of(sys.modules.get(top))
    return path is not None and _beneath(path, installed)


def _uses(fn: Any, visited: set[int]) -> Iterator[str]:
    """The modules of what `fn` uses: its closure's values and the globals its code names
    (nested functions' too); a function of the same module among them is followed in turn."""
    fn = getattr(fn, "__wrapped__", fn)      # a decorated function: the function itself
    if id(fn) in visited:
        return
    visited.add(id(fn))
    values = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:   # an empty cell
            continue
    code, glob = getattr(fn, "__code__", None), getattr(fn, "__globals__", {})
    values += [glob[n] for n in _code_names(code) if n in glob]
    for value in values:
        yield from _names_of(value)
        inner = getattr(value, "__wrapped__", value)
        if getattr(inner, "__globals__", None) is glob:
            yield from _uses(inner, visited)


def _code_names(code: Any) -> Iterator[str]:
    """The global names a code object and the code objects nested in it use."""
    if code is None:
        return
    yield from code.co_names
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            yield from _code_names(const)


def _made_in_memory(module: ModuleType) -> bool:
    """A module with no file that is neither built in, frozen, nor a namespace package: one
    a program made with `types.ModuleType`, which no other interpreter can import."""
    name = module.__name__
    spec = getattr(module, "__spec__", None)
    return not (name in sys.builtin_module_names or name.partition(".")[0] in
                sys.stdlib_module_names or hasattr(module, "__path__")
                or getattr(spec, "origin", None) in ("built-in", "frozen"))


def _referenced(module: ModuleType) -> Iterator[str]:
    """The names of the modules that `module`'s namespace holds or takes objects from."""
    for value in list(vars(module).values()):
        yield from _names_of(value)


def _names_of(value: Any) -> Iterator[str]:
    """The module `value` is, or the one it comes from."""
    if isinstance(value, ModuleType):
        yield value.__name__
        return
    owner = getattr(value, "__module__", None)
    if isinstance(owner, str):
        yield owner


def _file_of(module: ModuleType | None) -> Path | None:
    file = getattr(module, "__file__", None)
    return Path(os.path.realpath(file)) if isinstance(file, str) else None


def _installed_roots() -> list[str]:
    """The interpreter's own directories: a module beneath one is installed, not local."""
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    roots.update(site.getsitepackages())
    roots.update(p for p in sys.path if p.endswith(("site-packages", "dist-packages")))
    roots.update({sys.base_prefix, sys.base_exec_prefix})
    return sorted(os.path.realpath(r) for r in roots if r)


def _beneath(path: Path, roots: list[str]) -> bool:
    text = str(path)
    return any(text == r or text.startswith(r.rstrip("/") + "/") for r in roots)


def _bundle_paths(name: str, path: Path) -> dict[str, Path]:
    """Where module `name` (file `path`) lies in the bundle, with its packages' `__init__.py`."""
    parts = name.split(".")
    out: dict[str, Path] = {}
    if path.name.startswith("__init__."):
        out["/".join(parts) + "/" + path.name] = path
        parents, directory = parts[:-1], path.parent.parent
    else:
        out["/".join([*parts[:-1], path.name])] = path
        parents, directory = parts[:-1], path.parent
    for depth in range(len(parents), 0, -1):   # pkg/sub/__init__.py, then pkg/__init__.py
        init = directory / "__init__.py"
        if init.is_file():
            out["/".join(parents[:depth]) + "/__init__.py"] = Path(os.path.realpath(init))
        directory = directory.parent
    return out


def _distributions(tops: set[str]) -> dict[str, frozenset[str]]:
    """The installed distributions that provide the top-level modules `tops`, each with
    those of `tops` it provides."""
    if not tops:
        return {}
    provided = importlib.metadata.packages_distributions()
    found: dict[str, set[str]] = {}
    for top in sorted(tops - set(sys.stdlib_module_names)):
        for dist in provided.get(top, []):
            found.setdefault(dist, set()).add(top)
    return {dist: frozenset(names) for dist, names in found.items()}


def staged(files: dict[str, Path]) -> Path:
    """A temporary directory holding `files` at their bundle paths, for the bundle packer;
    the caller removes it (`shutil.rmtree`)."""
    root = Path(tempfile.mkdtemp(prefix="e31-code-"))
    try:
        for rel, source in sorted(files.items()):
            target = root / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return root
