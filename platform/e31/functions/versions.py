"""The version check at the call: the caller's Python and the versions of the packages the
function imports, and the installed modules it imports that no package provides, against the
environments of the live workers that would run it, before anything is uploaded or stored.

Each worker publishes its environment (`e31.ops.pyenvs`) and the API answers the distinct ones
of the workers serving the job's queue (`GET /v1/pool/environments`). When every one of them
differs from the caller's, the call is refused here with a `FunctionError` naming the package
(or the Python, or a module without package metadata that the worker does not list as
importable), so a mismatch costs no stored job and no attempt. The check is skipped, and
the worker's own check (`e31_worker.workloads.function`) is what remains, when nothing can be
told from here: no live worker of the class, one whose environment is not known, a job that
builds its own environment (`python=`), an older API without the route.

The answer is kept `CACHE_S` per API and resources, so that a loop of `.remote` calls (or a
`.map` over many arrays) asks once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from e31.core.errors import ClientError, FunctionError
from e31.core.functioncalls import mismatches, unimportable

if TYPE_CHECKING:
    from e31.client.client import Client

CACHE_S = 30.0
ROUTE_MISSING = (404, 405)    # an API older than the route: the worker alone checks
QUERY_FIELDS = ("gpus", "gpu_mem_gb", "size_class")   # what picks the job's class

_cache: dict[tuple[str, tuple[tuple[str, Any], ...]], tuple[float, dict[str, Any] | None]] = {}
_lock = threading.Lock()


def check(client: Client, spec: Mapping[str, Any], theirs: Mapping[str, Any], *,
          modules: Mapping[str, Iterable[str]] | None = None,
          unpackaged: Iterable[str] = ()) -> None:
    """Refuse the call (`FunctionError`) when no live worker that would run a job of `spec`
    has `theirs`, the caller's Python and packages (`functioncalls.facts`), each package
    named with its `modules` the function uses, and can import each of `unpackaged`, the
    installed modules it uses that no package provides; see the module."""
    if spec.get("python") is not None:
        return     # its own environment, built on the worker: only there can it be told
    answer = _environments(client, dict(spec.get("resources") or {}))
    why = (refusal(answer, theirs, modules=modules, unpackaged=unpackaged)
           if answer is not None else None)
    if why is not None:
        raise FunctionError(why)


def refusal(answer: Mapping[str, Any], theirs: Mapping[str, Any], *,
            modules: Mapping[str, Iterable[str]] | None = None,
            unpackaged: Iterable[str] = ()) -> str | None:
    """Why no worker of `answer` (the route's) can run a call of `theirs` that imports the
    modules `unpackaged`, naming what differs on the worker nearest to it; None when one
    can, or when it cannot be told (an environment that lists no modules is not judged on
    them)."""
    envs = answer.get("environments") or []
    if not envs or answer.get("unknown"):
        return None
    needed = sorted(set(unpackaged))
    found = [(mismatches(theirs, env, modules=modules), unimportable(needed, env))
             for env in envs]
    if any(not wrong and not lacking for wrong, lacking in found):
        return None
    wrong, lacking = min(found, key=lambda f: len(f[0]) + len(f[1]))
    where = f"class {answer.get('size_class')}" if answer.get("size_class") else "its class"
    more = f" (the nearest of its {len(envs)} environments)" if len(envs) > 1 else ""
    advice = []
    if wrong:
        advice.append("Install the same versions on both sides, or give the function "
                      "python={'pip': [...]} to add a package the workers lack")
    if lacking:
        advice.append("Install the module on the workers too, or put it beside your script "
                      "(or in your project) so that it travels with the call")
    return (f"this call cannot run on any live worker of {where}{more}: "
            + "; ".join(wrong + lacking) + ". " + ". ".join(advice)
            + " (docs/notebooks.md); nothing was stored")


def _environments(client: Client, resources: Mapping[str, Any]) -> dict[str, Any] | None:
    """The route's answer for `resources`, cached; None when the API has no such route."""
    query = tuple(sorted((k, resources[k]) for k in QUERY_FIELDS
                         if resources.get(k) is not None))
    key = (client.url, query)
    now = time.monotonic()
    with _lock:
        cached = _cache.get(key)
    if cached is not None and now - cached[0] < CACHE_S:
        return cached[1]
    try:
        answer: dict[str, Any] | None = client.environments(**dict(query))
    except ClientError as exc:
        if exc.status_code not in ROUTE_MISSING:
            raise
        answer = None
    with _lock:
        _cache[key] = (now, answer)
    return answer
