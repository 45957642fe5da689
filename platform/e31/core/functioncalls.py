"""How a Python function call travels as a job: the names both sides agree on.

`@e31.function` (`e31.functions`, the caller's side) turns a call into an ordinary job of the
`function` workload (`e31_worker.workloads.function`, the worker's side): the function is an
uploaded bundle entry given to the job as the input `e31_function`, the arguments another one
(`e31_args`, a list of one pickled call per item of a `.map`, the job's `params.item` picking
its own), and the value comes back as the output file `result.pkl`. The platform reads only
JSON: the job's result is a preview (`{"e31_function": {"type", "bytes", "preview"}}`), and it
never unpickles a call or a value. docs/notebooks.md, "How a call travels".

The function's envelope (`function.pkl`) is a plain pickle of builtins (the caller's Python
and package versions beside the cloudpickled function), so that the worker can compare the
versions before it unpickles anything of the user's (`mismatches`).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import pkgutil
import re
import sys
from collections.abc import Iterable, Mapping
from typing import Any

FUNCTION_ENTRYPOINT = "e31_worker.workloads.function:run"
FUNCTION_INPUT = "e31_function"    # the input holding the envelope: facts, function, shared kwargs
ARGS_INPUT = "e31_args"            # the input holding the items' pickled (args, kwargs)
FUNCTION_FILE = "function.pkl"     # the envelope's entry in its bundle
ARGS_FILE = "args.pkl"             # a list of pickled calls, one per item, in its bundle
RESULT_FILE = "result.pkl"         # outputs: the value, cloudpickled
EXCEPTION_FILE = "exception.pkl"   # outputs: the exception, cloudpickled, when it pickles
TRACEBACK_FILE = "traceback.txt"   # outputs: the remote traceback's text
RESULT_MARK = "e31_function"       # the JSON result's key: what kind of value it is
PREVIEW_CHARS = 200                # of the value's repr in the JSON result


def python_version() -> str:
    """This interpreter's `major.minor`: cloudpickled code only loads under the same one."""
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def installed_versions(distributions: Iterable[str]) -> dict[str, str | None]:
    """The installed version of each distribution named, None for one not installed."""
    found: dict[str, str | None] = {}
    for name in distributions:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def facts(distributions: Iterable[str]) -> dict[str, Any]:
    """What a call needs of the interpreter that runs it: this Python and these packages."""
    return {"python": python_version(), "packages": installed_versions(sorted(distributions))}


def environment() -> dict[str, Any]:
    """This interpreter's whole environment, as a worker publishes it for the callers to check
    their calls against before they store a job: its Python, every installed distribution's
    version (the first found on `sys.path`, as `importlib.metadata.version` finds it) and the
    names of the top-level modules it can import (`importable_modules`)."""
    packages: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name and name not in packages:
            packages[name] = dist.version
    return {"python": python_version(), "packages": dict(sorted(packages.items())),
            "modules": importable_modules()}


def importable_modules() -> list[str]:
    """The top-level modules this interpreter can import, by name, sorted: those on its
    `sys.path` (`pkgutil.iter_modules`: files, packages, extensions), the directories there
    that a namespace package may be (no `__init__.py`, which `pkgutil` passes over), the
    built-in ones and the standard library's. What a caller's module that has no package
    metadata, and so no version to compare, is looked for in (`unimportable`)."""
    names = {m.name for m in pkgutil.iter_modules()}
    for entry in sys.path:
        try:
            with os.scandir(entry or ".") as found:
                names.update(e.name for e in found if e.name.isidentifier()
                             and e.name != "__pycache__" and e.is_dir())
        except OSError:   # a missing entry, a zip file: pkgutil has read what it can
            continue
    names.update(sys.builtin_module_names, sys.stdlib_module_names)
    return sorted(names)


def environment_digest(env: Mapping[str, Any]) -> str:
    """The sha256 of `env`'s canonical JSON: what names it in a heartbeat and in Redis, so that
    a thousand workers of one image store it once."""
    text = json.dumps(env, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def mismatches(theirs: Mapping[str, Any], ours: Mapping[str, Any], *,
               modules: Mapping[str, Iterable[str]] | None = None) -> list[str]:
    """Each way the caller's `theirs` differs from the worker's `ours`, one sentence each,
    naming the Python or the package (and, from `modules`, its modules the call uses when
    their names differ from the package's); empty when the call may run here."""
    found = []
    if theirs.get("python") != ours.get("python"):
        found.append(f"Python {theirs.get('python')} on the caller's side, "
                     f"{ours.get('python')} on the worker")
    mine = {canonical(n): v for n, v in (ours.get("packages") or {}).items()}
    for name, version in sorted((theirs.get("packages") or {}).items()):
        if version is None:
            continue
        here = mine.get(canonical(name))
        if here != version:
            found.append(f"package {name} {version}{_modules_of(name, modules)} on the "
                         f"caller's side, {here or 'not installed'} on the worker")
    return found


def _modules_of(name: str, modules: Mapping[str, Iterable[str]] | None) -> str:
    """` (module yaml)` for the package PyYAML; "" when its module is named as it is."""
    names = sorted(set((modules or {}).get(name, ())) - {name})
    if not names:
        return ""
    return f" (module{'s' if len(names) > 1 else ''} {', '.join(names)})"


def unimportable(needed: Iterable[str], ours: Mapping[str, Any]) -> list[str]:
    """Each of `needed` (top-level modules installed on the caller's side without package
    metadata: no version to compare, and they do not travel with the call) that the worker's
    environment `ours` does not list as importable, one sentence each; none when `ours` lists
    no modules (a worker older than the list: not judged here, the worker's own load names it)."""
    listed = ours.get("modules")
    if not isinstance(listed, list):
        return []
    have = set(listed)
    return [f"module {name} (installed on the caller's side without package metadata) is not "
            "importable on the worker" for name in sorted(set(needed)) if name not in have]


def canonical(name: str) -> str:
    """A distribution's name as PEP 503 compares them (`PyYAML`, `pyyaml`, `ruamel.yaml` and
    `ruamel-yaml` alike): two installers may spell one package's metadata differently."""
    return re.sub(r"[-_.]+", "-", name).lower()


def preview(value: Any, size_bytes: int) -> dict[str, Any]:
    """The JSON result of a function job: the value's type, its pickle's size and a short repr."""
    kind = type(value)
    try:
        text = repr(value)
    except Exception as exc:  # noqa: BLE001 - a user's __repr__ may raise anything
        text = f"<repr failed: {type(exc).__name__}>"
    if len(text) > PREVIEW_CHARS:
        text = text[:PREVIEW_CHARS - 1] + "…"
    return {RESULT_MARK: {"type": f"{kind.__module__}.{kind.__qualname__}",
                          "bytes": size_bytes, "preview": text}}


def is_function_result(result: Any) -> bool:
    """Whether a job's JSON result is a function job's preview (its value is `result.pkl`)."""
    return isinstance(result, Mapping) and isinstance(result.get(RESULT_MARK), Mapping)
