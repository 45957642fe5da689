"""The control plane's table of built-in workloads: short names to entrypoints."""

from __future__ import annotations

import subprocess
import sys

import pytest

from e31.core.errors import SpecError
from e31.core.spec import JobSpec
from e31.core.workloads import WORKLOADS


@pytest.mark.parametrize(("name", "entrypoint"), [
    ("batch-inference", "e31_worker.workloads.batch_inference:run"),
    ("train", "e31_worker.workloads.training:run"),
    ("footage", "e31_worker.workloads.footage:run"),
    ("llm", "e31_worker.workloads.llm:run"),
])
def test_each_short_name_stands_for_its_entrypoint(name: str, entrypoint: str) -> None:
    # Given a spec that names a built-in workload by its short name
    # When it is parsed
    spec = JobSpec.parse({"workload": name})

    # Then it runs that workload's module:function of e31_worker.workloads
    assert spec.entrypoint == entrypoint
    assert set(WORKLOADS) == {"batch-inference", "train", "footage", "llm"}


def test_an_unknown_name_is_a_spec_error_that_lists_the_known_ones() -> None:
    # Given a name that is not in the table
    # When a spec names it
    with pytest.raises(SpecError) as refused:
        JobSpec.parse({"workload": "trian"})

    # Then the error names the field and every known workload
    [error] = refused.value.errors
    assert error["field"] == "workload"
    assert "'trian'" in error["reason"]
    assert all(name in error["reason"] for name in WORKLOADS)


def test_the_table_imports_without_torch_or_the_worker_package() -> None:
    # Given a fresh interpreter
    # When it imports the control plane's table
    code = ("import sys, e31.core.workloads; "
            "print(sorted(m for m in ('torch', 'e31_worker') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)

    # Then neither torch nor e31_worker came with it
    assert out.stdout.strip() == "[]"


def test_a_spec_may_name_a_built_in_workload_by_its_short_name() -> None:
    spec = JobSpec.parse({"workload": "train", "params": {"epochs": 1}})

    assert spec.entrypoint == "e31_worker.workloads.training:run"
    assert "workload" not in spec.model_dump(mode="json")  # the store keeps the entrypoint


@pytest.mark.parametrize("body", [{"workload": "nope"},
                                  {"workload": "train", "entrypoint": "pkg.mod:main"},
                                  {"workload": "train", "command": ["true"]}])
def test_an_unknown_or_doubled_workload_is_refused_on_the_workload_field(body: dict) -> None:
    with pytest.raises(SpecError) as refused:
        JobSpec.parse(body)

    assert [e["field"] for e in refused.value.errors] == ["workload"]
