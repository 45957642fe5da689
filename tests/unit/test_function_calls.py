"""Pickling a call for `@e31.function` (`e31.functions.calls`, `e31.functions.uploads`) and
the decorator's spec: what will not travel is refused at the call, naming the argument."""

from __future__ import annotations

import pickle
import threading

import cloudpickle
import pytest

import e31
from e31.core.errors import FunctionError, SpecError
from e31.core.functioncalls import mismatches, python_version
from e31.functions import calls, uploads
from e31.functions.decorator import spec_of


class OnGpu:
    """Looks like a CUDA tensor to the check, which never imports torch."""

    is_cuda = True
    device = "cuda:0"


def test_an_argument_that_cannot_be_pickled_is_named_with_its_type() -> None:
    with pytest.raises(FunctionError,
                       match=r"argument 1 \(_thread\.lock\) of item 4 cannot be pickled"):
        calls.call_bytes((1, threading.Lock()), {}, where=" of item 4")


def test_a_keyword_argument_on_a_gpu_is_refused_before_anything_is_pickled() -> None:
    with pytest.raises(FunctionError, match="argument 'model' of item 2 is a tensor on cuda:0"):
        calls.call_bytes((), {"model": OnGpu()}, where=" of item 2")


def test_a_function_closing_over_a_gpu_value_is_refused_naming_the_variable() -> None:
    weights = OnGpu()

    def score(x: int) -> object:
        return weights, x

    with pytest.raises(FunctionError, match="the variable 'weights'"):
        calls.envelope(score, {}, frozenset())


def test_the_envelope_holds_the_versions_in_plain_pickle_beside_the_cloudpickled_function(
        ) -> None:
    data = calls.envelope(lambda x: x + 1, {"k": 2}, frozenset({"pytest"}))
    envelope = pickle.loads(data)
    assert envelope["facts"]["python"] == python_version()
    assert envelope["facts"]["packages"]["pytest"] == pytest.__version__
    assert cloudpickle.loads(envelope["function"])(1) == 2
    assert cloudpickle.loads(envelope["kwargs"]) == {"k": 2}


def test_a_version_mismatch_names_the_package_and_both_versions() -> None:
    theirs = {"python": "3.11", "packages": {"numpy": "2.0.0", "absent": None}}
    ours = {"python": "3.12", "packages": {"numpy": "1.26.4"}}
    assert mismatches(theirs, ours) == [
        "Python 3.11 on the caller's side, 3.12 on the worker",
        "package numpy 2.0.0 on the caller's side, 1.26.4 on the worker"]


def test_small_calls_go_in_one_group_and_big_ones_are_split_by_size() -> None:
    assert uploads._groups([b"x"] * 10_000) == [(0, 10_000)]
    big = b"x" * (uploads.CALL_BUNDLE_MAX_BYTES // 2 + 1)
    assert uploads._groups([big, big, b"y", big]) == [(0, 1), (1, 3), (3, 4)]


def test_the_decorator_gathers_resources_asks_for_no_gpu_and_refuses_a_bad_field() -> None:
    assert spec_of({"timeout_s": 60, "retries": 2})["resources"] == {"gpus": 0}
    spec = spec_of({"gpus": 1, "gpu_mem_gb": 20, "retries": 2})
    assert spec["resources"] == {"gpus": 1, "gpu_mem_gb": 20} and spec["retries"] == {"max": 2}
    with pytest.raises(SpecError, match="timeout_s"):
        spec_of({"timeout_s": -1})
    with pytest.raises(SpecError, match="inputs.e31_args"):
        spec_of({"inputs": {"e31_args": "s3://b/k"}})


def test_local_calls_the_function_here_and_a_function_pickles_without_its_client() -> None:
    @e31.function(timeout_s=30)
    def add(a: int, b: int) -> int:
        return a + b

    assert add.local(2, 3) == 5
    assert add.__name__ == "add"
    assert cloudpickle.loads(cloudpickle.dumps(add)).local(1, 1) == 2
