"""The `function` workload in process (`e31_worker.workloads.function`): one item's call from
its staged inputs, the value as `result.pkl`, an exception as the job's error with its files."""

from __future__ import annotations

import pickle
from pathlib import Path

import cloudpickle
import pytest

from e31.core.errors import FunctionError, SetupError
from e31.core.functioncalls import (
    ARGS_INPUT,
    EXCEPTION_FILE,
    FUNCTION_INPUT,
    RESULT_FILE,
    RESULT_MARK,
    TRACEBACK_FILE,
)
from e31.functions.calls import call_bytes, calls_file, envelope
from e31_worker.child.context import JobContext
from e31_worker.workloads import function


def _ctx(tmp_path: Path, fn: object, items: list[tuple[tuple[object, ...], dict[str, object]]],
         facts_packages: frozenset[str] = frozenset()) -> JobContext:
    """A context whose inputs hold `fn`'s envelope and the items' calls, as staged."""
    inputs, out = tmp_path / "inputs", tmp_path / "out"
    inputs.mkdir()
    out.mkdir()
    (inputs / FUNCTION_INPUT).write_bytes(envelope(fn, {"scale": 10}, facts_packages))
    (inputs / ARGS_INPUT).write_bytes(calls_file([call_bytes(a, k) for a, k in items]))
    return JobContext(job_id="j-test", attempt=1, params={}, output_dir=out,
                      checkpoint_dir=tmp_path / "ck", work_dir=tmp_path, progress_path=None,
                      gpus="", input_dir=inputs)


def test_an_item_s_value_is_its_result_pkl_and_the_json_result_is_a_preview(
        tmp_path: Path) -> None:
    ctx = _ctx(tmp_path, lambda x, y=0, scale=1: [x * scale, y], [((1,), {}), ((2,), {"y": 5})])
    result = function.run(ctx, item=1)
    assert cloudpickle.loads((ctx.output_dir / RESULT_FILE).read_bytes()) == [20, 5]
    assert result[RESULT_MARK]["type"] == "builtins.list"
    assert result[RESULT_MARK]["preview"] == "[20, 5]"


def test_an_exception_fails_the_job_and_leaves_its_pickle_and_traceback(tmp_path: Path) -> None:
    def bad(x: int, scale: int) -> None:
        raise KeyError(f"no {x}")

    ctx = _ctx(tmp_path, bad, [((7,), {})])
    with pytest.raises(KeyError):
        function.run(ctx, item=0)
    text = (ctx.output_dir / TRACEBACK_FILE).read_text()
    assert "in bad" in text and "KeyError: 'no 7'" in text and "workloads" not in text
    assert isinstance(cloudpickle.loads((ctx.output_dir / EXCEPTION_FILE).read_bytes()), KeyError)


def test_a_package_version_unlike_the_workers_fails_before_the_function_is_unpickled(
        tmp_path: Path) -> None:
    ctx = _ctx(tmp_path, lambda x, scale: x, [((1,), {})], frozenset({"pytest"}))
    path = ctx.input_dir / FUNCTION_INPUT
    env = pickle.loads(path.read_bytes())
    env["facts"]["packages"]["pytest"] = "0.0.1"
    env["function"] = b"not a pickle at all"
    path.write_bytes(pickle.dumps(env))
    with pytest.raises(SetupError, match="package pytest 0.0.1 on the caller's side"):
        function.run(ctx, item=0)


def test_a_value_over_the_pools_outputs_limit_fails_the_item_naming_size_and_limit(
        tmp_path: Path) -> None:
    # Given an item whose value pickles to more than the pool's outputs limit
    ctx = _ctx(tmp_path, lambda n, scale=1: b"x" * n, [((5000,), {})])
    ctx.outputs_max_bytes = 1000

    # When it runs, Then it fails with the size and the limit, and stores no result
    with pytest.raises(FunctionError, match=r"bytes pickled, over the pool's outputs limit of "
                                            r"1000 bytes \(job_outputs_max_bytes\)"):
        function.run(ctx, item=0)
    assert not (ctx.output_dir / RESULT_FILE).exists()

    # And without the limit (or under it) the same value is stored
    ctx.outputs_max_bytes = None
    function.run(ctx, item=0)
    assert (ctx.output_dir / RESULT_FILE).exists()
