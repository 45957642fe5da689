"""The `function` workload: one call of a Python function sent by `@e31.function`.

The job's inputs hold the call (`e31.core.functioncalls`): `e31_function`, the envelope with
the caller's Python and package versions, the cloudpickled function and the keyword arguments
every item shares; `e31_args`, the items' pickled (args, kwargs), of which `params.item` is
this job's. The versions are compared before anything of the user's is unpickled, so a
mismatch fails the job naming the package instead of failing somewhere inside pickle.

The value goes to the output `result.pkl` (cloudpickled, read back by its owner's client
alone: the platform never unpickles it) and the JSON result is its preview. An exception the
function raises fails the job as the user's error, with `exception.pkl` (when it pickles) and
`traceback.txt` in the outputs, for the client to re-raise with the remote traceback.
"""

from __future__ import annotations

import pickle
import traceback
from pathlib import Path
from typing import Any

import cloudpickle

from e31.core.errors import FunctionError, SetupError
from e31.core.functioncalls import (
    ARGS_INPUT,
    EXCEPTION_FILE,
    FUNCTION_INPUT,
    RESULT_FILE,
    TRACEBACK_FILE,
    facts,
    mismatches,
    preview,
)
from e31_worker.child.context import JobContext


def run(ctx: JobContext, item: int = 0) -> dict[str, Any]:
    """Call the function with item `item`'s arguments; its value is the output `result.pkl`."""
    envelope = _read_pickle(Path(ctx.input_path(FUNCTION_INPUT)))
    wrong = mismatches(envelope["facts"], facts(envelope["facts"].get("packages") or {}))
    if wrong:
        raise SetupError("this call cannot run on this worker: " + "; ".join(wrong) +
                         ". Install the same versions on both sides (docs/notebooks.md)")
    fn, shared = _loads(envelope["function"], "the function"), _loads(envelope["kwargs"],
                                                                      "the shared arguments")
    calls = _read_pickle(Path(ctx.input_path(ARGS_INPUT)))
    args, kwargs = _loads(calls[item], f"the arguments of item {item}")
    try:
        value = fn(*args, **shared, **kwargs)
    except Exception as exc:
        _write_exception(ctx.output_dir, exc)
        raise
    data = cloudpickle.dumps(value)
    limit = ctx.outputs_max_bytes
    if limit is not None and len(data) > limit:
        raise FunctionError(f"the function's value is {len(data)} bytes pickled, over the "
                            f"pool's outputs limit of {limit} bytes (job_outputs_max_bytes): "
                            "return something smaller, or write it to ctx.output_dir in parts "
                            "(docs/notebooks.md)")
    _write(ctx.output_dir / RESULT_FILE, data)
    return preview(value, len(data))


def _read_pickle(path: Path) -> Any:
    """A plain pickle of builtins that the client wrote (the envelope, the list of calls)."""
    with open(path, "rb") as f:
        return pickle.load(f)


def _loads(data: bytes, what: str) -> Any:
    """Unpickle `what`; a module the worker cannot import is named in the error."""
    try:
        return cloudpickle.loads(data)
    except ModuleNotFoundError as exc:
        raise SetupError(f"cannot load {what}: module {exc.name!r} is not importable on the "
                         "worker (a local module travels with the call only when the function's "
                         "module imports it; an installed one must be installed on the pool "
                         "too)") from exc


def _write_exception(output_dir: Path, exc: Exception) -> None:
    """`traceback.txt` (the frames below this workload's) and, when it pickles, the exception."""
    tb = traceback.TracebackException.from_exception(exc)
    tb.stack = traceback.StackSummary.from_list(
        [f for f in tb.stack if f.filename != __file__])
    _write(output_dir / TRACEBACK_FILE, "".join(tb.format()).encode())
    try:
        data = cloudpickle.dumps(exc)
    except Exception:  # noqa: BLE001 - any exception may hold what cannot be pickled
        return
    _write(output_dir / EXCEPTION_FILE, data)


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
