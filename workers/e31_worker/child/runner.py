"""The job child of an `entrypoint` job: `python -m e31_worker.child.runner JOB_JSON`.

Imports `module:function`, calls it with a `JobContext` and the params, and writes the
JSON result (or the error) next to JOB_JSON for the supervising worker to read. Right before
the entrypoint is imported (the job's first line of code) it notes the monotonic time in
`started` next to JOB_JSON; a warm start (`e31_worker.child.zygote`) tells it over its
status pipe instead (`on_user_code`). The worker's start latency is measured to there.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from e31_worker.child.context import JobContext

EXIT_ERROR = 1
STARTED_FILE = "started"   # when the job's code started (time.monotonic()), for the worker


def load_entrypoint(entrypoint: str) -> Callable[..., Any]:
    module_name, _, attr = entrypoint.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{entrypoint} is not callable")
    return obj


def is_out_of_memory(exc: BaseException) -> bool:
    """A CUDA out-of-memory error (torch.OutOfMemoryError, or older torch's RuntimeError
    saying so) or Python's MemoryError: the attempt ends with reason `oom`."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    return isinstance(exc, RuntimeError) and "CUDA out of memory" in str(exc)


def _write(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(payload, allow_nan=False))
    os.replace(tmp, path)


def main(argv: list[str], on_user_code: Callable[[], None] | None = None) -> int:
    job_file = Path(argv[0])
    job = json.loads(job_file.read_text())
    result_path = job_file.with_name("result.json")
    error_path = job_file.with_name("error.json")
    if on_user_code is not None:
        on_user_code()
    else:
        try:
            _write(job_file.with_name(STARTED_FILE), {"monotonic": time.monotonic()})
        except OSError:  # only the start latency's note is lost
            pass
    try:
        fn = load_entrypoint(job["entrypoint"])
    except Exception as exc:  # noqa: BLE001 - any import failure is the job's error
        traceback.print_exc()
        _write(error_path, {"error": f"cannot import entrypoint {job['entrypoint']}: "
                                     f"{type(exc).__name__}: {exc}"})
        return EXIT_ERROR
    # `ctx.log` and the job's own loggers reach its log, as its prints do.
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    ctx = JobContext.from_env(job["params"])
    try:
        value = fn(ctx, **job["params"])
    except Exception as exc:  # noqa: BLE001 - whatever the job raises is its error
        traceback.print_exc()
        _write(error_path, {"error": f"{type(exc).__name__}: {exc}",
                            "reason": "oom" if is_out_of_memory(exc) else "error"})
        return EXIT_ERROR
    try:
        _write(result_path, {"result": value})
    except (TypeError, ValueError) as exc:
        _write(error_path, {"error": f"result is not JSON: {exc}"})
        print(f"e31: the entrypoint's return value is not JSON: {exc}", file=sys.stderr)
        return EXIT_ERROR
    return 0


if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    sys.exit(main(sys.argv[1:]))
