"""`JobSpec.parse`, `RetryPolicy.delay_s` and `load_spec_file`: the one door for job input."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from e31.core.errors import SpecError
from e31.core.retries import RetryPolicy
from e31.core.spec import JobSpec, load_spec_file


def refusal(data: Any) -> list[dict[str, str]]:
    """Parse `data`, expecting a refusal; return the error entries."""
    with pytest.raises(SpecError) as caught:
        JobSpec.parse(data)
    errors = caught.value.errors
    assert errors, "a SpecError must carry at least one entry"
    for entry in errors:
        assert set(entry) == {"field", "reason"}
        assert entry["field"] and entry["reason"]
    return errors


def fields(errors: list[dict[str, str]]) -> set[str]:
    return {e["field"] for e in errors}


def reason_for(errors: list[dict[str, str]], field: str) -> str:
    return next(e["reason"] for e in errors if e["field"] == field)


# -- accepted ------------------------------------------------------------------------------


def test_a_valid_entrypoint_job_is_accepted_with_every_field_kept() -> None:
    # Given the spec from the architecture's contract
    data = {"name": "finetune-resnet", "entrypoint": "mypkg.train:main", "params": {"epochs": 3},
            "resources": {"gpus": 1, "gpu_mem_gb": 40}, "timeout_s": 7200,
            "retries": {"max": 3, "backoff_s": 10, "backoff_max_s": 600}, "priority": 7}

    # When it is parsed
    spec = JobSpec.parse(data)

    # Then every field is kept and the job is an entrypoint job
    assert spec.kind == "entrypoint"
    assert spec.entrypoint == "mypkg.train:main"
    assert spec.command is None
    assert spec.params == {"epochs": 3}
    assert spec.resources.gpus == 1 and spec.resources.gpu_mem_gb == 40
    assert spec.timeout_s == 7200
    assert (spec.retries.max, spec.retries.backoff_s, spec.retries.backoff_max_s) == (3, 10, 600)
    assert spec.priority == 7
    assert spec.display_name == "finetune-resnet"


def test_a_command_job_is_accepted_and_named_after_its_program() -> None:
    # Given a command job without a name
    data = {"command": ["/usr/bin/python3", "train.py", "--epochs", "3"], "env": {"SEED": "1"}}

    # When it is parsed
    spec = JobSpec.parse(data)

    # Then it is a command job with its argv, environment and defaults
    assert spec.kind == "command"
    assert spec.command == ["/usr/bin/python3", "train.py", "--epochs", "3"]
    assert spec.entrypoint is None
    assert spec.env == {"SEED": "1"}
    assert spec.params == {}
    assert spec.resources.gpus == 1
    assert spec.priority == 5
    assert spec.display_name == "python3"


def test_an_entrypoint_job_without_a_name_is_named_after_its_function() -> None:
    # Given an entrypoint job without a name
    # When it is parsed
    spec = JobSpec.parse({"entrypoint": "pkg.mod:main"})

    # Then its display name is the function
    assert spec.display_name == "main"


# -- refused -------------------------------------------------------------------------------


def test_an_unknown_top_level_field_is_refused_by_name() -> None:
    # Given a spec with a field the contract does not have
    # When it is parsed
    errors = refusal({"entrypoint": "m:f", "gpus": 1})

    # Then the error names that field as unknown
    assert fields(errors) == {"gpus"}
    assert reason_for(errors, "gpus") == "unknown field"


def test_an_unknown_nested_resources_field_is_refused_with_its_dotted_path() -> None:
    # Given resources with a field that does not exist
    # When it is parsed
    errors = refusal({"entrypoint": "m:f", "resources": {"gpus": 1, "foo": 2}})

    # Then the error names resources.foo as unknown
    assert fields(errors) == {"resources.foo"}
    assert reason_for(errors, "resources.foo") == "unknown field"


def test_a_job_with_both_entrypoint_and_command_is_refused() -> None:
    # Given both kinds of job at once
    # When it is parsed
    errors = refusal({"entrypoint": "m:f", "command": ["echo", "hi"]})

    # Then the error says to give exactly one of them
    assert fields(errors) == {"entrypoint"}
    assert "exactly one of entrypoint or command" in reason_for(errors, "entrypoint")


def test_a_job_with_neither_entrypoint_nor_command_is_refused() -> None:
    # Given a spec with nothing to run
    # When it is parsed
    errors = refusal({"name": "nothing", "params": {"a": 1}})

    # Then the error says to give exactly one of them
    assert fields(errors) == {"entrypoint"}
    assert "exactly one of entrypoint or command" in reason_for(errors, "entrypoint")


@pytest.mark.parametrize("timeout_s", [0, -1, -0.5])
def test_a_zero_or_negative_timeout_is_refused(timeout_s: float) -> None:
    # Given a timeout that leaves no time to run
    # When it is parsed
    errors = refusal({"entrypoint": "m:f", "timeout_s": timeout_s})

    # Then the error names timeout_s
    assert fields(errors) == {"timeout_s"}
    assert "greater than 0" in reason_for(errors, "timeout_s")


def test_a_timeout_that_is_not_a_number_is_refused() -> None:
    # Given NaN as a timeout (every comparison with it is false)
    # When it is parsed
    errors = refusal({"entrypoint": "m:f", "timeout_s": float("nan")})

    # Then the error names timeout_s
    assert fields(errors) == {"timeout_s"}


@pytest.mark.parametrize("priority", [10, -1])
def test_a_priority_outside_0_to_9_is_refused(priority: int) -> None:
    # Given a priority outside the 0..9 band
    # When it is parsed
    errors = refusal({"entrypoint": "m:f", "priority": priority})

    # Then the error names priority
    assert fields(errors) == {"priority"}


@pytest.mark.parametrize("priority", [0, 9])
def test_priorities_at_the_ends_of_the_band_are_accepted(priority: int) -> None:
    # Given the lowest and highest priorities
    # When they are parsed
    spec = JobSpec.parse({"entrypoint": "m:f", "priority": priority})

    # Then they are kept
    assert spec.priority == priority


def test_more_than_eight_gpus_are_refused() -> None:
    # Given a job asking for more GPUs than one node has
    # When it is parsed
    errors = refusal({"entrypoint": "m:f", "resources": {"gpus": 9}})

    # Then the error names resources.gpus
    assert fields(errors) == {"resources.gpus"}
    assert "8" in reason_for(errors, "resources.gpus")


def test_eight_gpus_are_accepted() -> None:
    # Given a job asking for a whole node
    # When it is parsed
    spec = JobSpec.parse({"entrypoint": "m:f", "resources": {"gpus": 8}})

    # Then it is kept
    assert spec.resources.gpus == 8


@pytest.mark.parametrize("value", [float("nan"), float("inf"), {1, 2}, object()],
                         ids=["nan", "infinity", "set", "object"])
def test_params_that_are_not_json_are_refused(value: Any) -> None:
    # Given params holding a value JSON cannot carry (parse receives Python objects)
    # When it is parsed
    errors = refusal({"entrypoint": "m:f", "params": {"x": value}})

    # Then the error names params and says they must be JSON
    assert fields(errors) == {"params"}
    assert "must be JSON" in reason_for(errors, "params")


def test_params_that_are_not_a_mapping_are_refused() -> None:
    # Given params that are a bare float
    # When it is parsed
    errors = refusal({"entrypoint": "m:f", "params": float("nan")})

    # Then the error names params
    assert fields(errors) == {"params"}


def test_params_larger_than_a_mebibyte_are_refused() -> None:
    # Given params whose JSON is over the size limit
    # When it is parsed
    errors = refusal({"entrypoint": "m:f", "params": {"blob": "x" * (1024 * 1024)}})

    # Then the error names params and says to pass a file instead
    assert fields(errors) == {"params"}
    assert "file" in reason_for(errors, "params")


@pytest.mark.parametrize("entrypoint", ["mypkg.train", "mypkg.train:", ":main", "my pkg:main",
                                        "1pkg:main", "pkg:main()", "pkg/train.py:main"])
def test_an_entrypoint_not_of_the_form_module_colon_function_is_refused(entrypoint: str) -> None:
    # Given an entrypoint that is not module:function
    # When it is parsed
    errors = refusal({"entrypoint": entrypoint})

    # Then the error names entrypoint and shows the expected form
    assert fields(errors) == {"entrypoint"}
    assert "package.module:function" in reason_for(errors, "entrypoint")


def test_an_entrypoint_may_name_a_nested_attribute() -> None:
    # Given a function reached through a class
    # When it is parsed
    spec = JobSpec.parse({"entrypoint": "pkg.jobs:Trainer.run"})

    # Then it is accepted
    assert spec.entrypoint == "pkg.jobs:Trainer.run"


def test_an_entrypoint_with_a_trailing_newline_is_refused() -> None:
    # Given an entrypoint pasted with its line ending
    # When it is parsed
    errors = refusal({"entrypoint": "pkg.train:main\n"})

    # Then it is refused rather than failing at import time in the worker
    assert fields(errors) == {"entrypoint"}


@pytest.mark.parametrize("command", [[], [""]], ids=["empty", "empty-program"])
def test_an_empty_command_is_refused(command: list[str]) -> None:
    # Given a command with no program to run
    # When it is parsed
    errors = refusal({"command": command})

    # Then the error names command
    assert fields(errors) == {"command"}
    assert "non-empty argv" in reason_for(errors, "command")


@pytest.mark.parametrize("name", ["CUDA_VISIBLE_DEVICES", "E31_JOB_ID", "E31_OUTPUT_DIR",
                                  "E31_ANYTHING"])
def test_env_may_not_override_what_the_worker_sets(name: str) -> None:
    # Given a job environment that would unpin the GPU or fake the job's identity
    # When it is parsed
    errors = refusal({"entrypoint": "m:f", "env": {"OK": "1", name: "x"}})

    # Then the error names env and the variable
    assert fields(errors) == {"env"}
    assert name in reason_for(errors, "env")


def test_a_secret_also_given_in_env_is_refused_naming_the_secret() -> None:
    # Given a job that names a secret and sets a variable of the same name in env
    # When it is parsed
    errors = refusal({"entrypoint": "m:f", "env": {"HF_TOKEN": "x"},
                      "secrets": ["WANDB_KEY", "HF_TOKEN"]})

    # Then the refusal names the secret and says to give it one way (a rule the API document
    # cannot state, which the fuzz test leaves to this test: tests/integration/fuzz_hooks.py)
    assert errors == [{"field": "secrets[1]",
                       "reason": "HF_TOKEN is also in env; give it one way"}]


def test_params_with_a_command_job_are_refused() -> None:
    # Given a command job that also carries params
    # When it is parsed
    errors = refusal({"command": ["echo", "hi"], "params": {"x": 1}})

    # Then the error names params
    assert fields(errors) == {"params"}
    assert "entrypoint" in reason_for(errors, "params")


def test_gpu_memory_without_gpus_is_refused() -> None:
    # Given a cpu job that asks for GPU memory
    # When it is parsed
    errors = refusal({"entrypoint": "m:f", "resources": {"gpus": 0, "gpu_mem_gb": 16}})

    # Then the error names resources and says why
    assert fields(errors) == {"resources"}
    assert "gpus >= 1" in reason_for(errors, "resources")


@pytest.mark.parametrize("data", [None, [], "entrypoint: m:f", 42],
                         ids=["none", "list", "str", "int"])
def test_input_that_is_not_a_mapping_is_refused_as_spec(data: Any) -> None:
    # Given input that is not a mapping of fields
    # When it is parsed
    errors = refusal(data)

    # Then the error names the spec as a whole
    assert errors == [{"field": "spec", "reason": "must be a mapping of fields"}]


def test_every_bad_field_is_reported_at_once() -> None:
    # Given a spec with three independent mistakes
    # When it is parsed
    errors = refusal({"entrypoint": "nope", "priority": 10, "timeout_s": -1})

    # Then each is named, so the user fixes them in one go
    assert fields(errors) == {"entrypoint", "priority", "timeout_s"}


def test_a_parsed_spec_is_frozen() -> None:
    # Given a parsed spec
    spec = JobSpec.parse({"entrypoint": "m:f"})

    # When a field is assigned
    # Then it is refused
    with pytest.raises(ValidationError):
        spec.priority = 9  # type: ignore[misc]
    assert spec.priority == 5


# -- RetryPolicy ---------------------------------------------------------------------------


def test_retry_delay_doubles_per_attempt_from_backoff_s() -> None:
    # Given a back-off of 10 s with a high cap
    policy = RetryPolicy(max=5, backoff_s=10, backoff_max_s=10_000)

    # When the delays after attempts 1..4 are computed
    delays = [policy.delay_s(n) for n in (1, 2, 3, 4)]

    # Then they double each time
    assert delays == [10, 20, 40, 80]


def test_retry_delay_is_capped_at_backoff_max_s() -> None:
    # Given a back-off of 10 s capped at 30 s
    policy = RetryPolicy(max=10, backoff_s=10, backoff_max_s=30)

    # When late attempts are computed
    # Then they never exceed the cap
    assert policy.delay_s(2) == 20
    assert policy.delay_s(3) == 30
    assert policy.delay_s(10) == 30
    assert policy.delay_s(100) == 30


def test_retry_delay_for_attempt_zero_is_the_base_back_off() -> None:
    # Given a back-off of 10 s
    policy = RetryPolicy(backoff_s=10)

    # When the attempt number is 0 (before any attempt)
    # Then the delay is not halved
    assert policy.delay_s(0) == 10


def test_the_default_retry_policy_does_not_retry() -> None:
    # Given a spec without retries
    spec = JobSpec.parse({"entrypoint": "m:f"})

    # Then no retry is made, with 10 s back-off capped at 600 s if one were
    assert spec.retries.max == 0
    assert spec.retries.delay_s(1) == 10
    assert spec.retries.delay_s(20) == 600


def test_the_pools_retry_policy_fills_only_the_retry_fields_a_spec_leaves_out() -> None:
    # Given the pool's retry policy, a spec that sets only retries.max and one without retries
    pool = RetryPolicy(max=2, backoff_s=3, max_lost=5)
    partial = JobSpec.parse({"entrypoint": "m:f", "retries": {"max": 7}})
    plain = JobSpec.parse({"entrypoint": "m:f"})

    # When the pool's policy is laid under each
    # Then the spec's own field wins, the others come from the pool, and the spec is unchanged
    assert partial.with_retry_defaults(pool).retries.model_dump() == \
        {"max": 7, "backoff_s": 3.0, "backoff_max_s": 600.0, "max_lost": 5}
    assert plain.with_retry_defaults(pool).retries.model_dump() == pool.model_dump()
    assert partial.retries.model_dump() == RetryPolicy(max=7).model_dump()


# -- load_spec_file ------------------------------------------------------------------------


def test_a_yaml_spec_file_is_read_into_a_mapping_that_parses(tmp_path) -> None:
    # Given a YAML spec file
    path = tmp_path / "job.yaml"
    path.write_text("name: finetune\n"
                    "entrypoint: mypkg.train:main\n"
                    "params: {epochs: 3}\n"
                    "resources: {gpus: 1, gpu_mem_gb: 40}\n"
                    "retries: {max: 3}\n")

    # When it is loaded and parsed
    data = load_spec_file(path)
    spec = JobSpec.parse(data)

    # Then its fields are there
    assert data["params"] == {"epochs": 3}
    assert spec.entrypoint == "mypkg.train:main"
    assert spec.resources.gpu_mem_gb == 40
    assert spec.retries.max == 3


def test_a_json_spec_file_is_read_into_a_mapping(tmp_path) -> None:
    # Given a JSON spec file
    path = tmp_path / "job.json"
    path.write_text(json.dumps({"command": ["echo", "hi"], "priority": 2}))

    # When it is loaded (accepting a str path too)
    data = load_spec_file(str(path))

    # Then it is the mapping written
    assert data == {"command": ["echo", "hi"], "priority": 2}
    assert JobSpec.parse(data).priority == 2


def test_bad_yaml_is_refused_naming_spec_and_the_file(tmp_path) -> None:
    # Given a YAML file with an unclosed list
    path = tmp_path / "job.yaml"
    path.write_text("entrypoint: m:f\nparams: [1, 2\n")

    # When it is loaded
    with pytest.raises(SpecError) as caught:
        load_spec_file(path)

    # Then the error names spec and says the file is not YAML
    [entry] = caught.value.errors
    assert entry["field"] == "spec"
    assert "not valid YAML" in entry["reason"] and str(path) in entry["reason"]


def test_bad_json_is_refused_naming_spec(tmp_path) -> None:
    # Given a .json file that is not JSON
    path = tmp_path / "job.json"
    path.write_text("{'entrypoint': 'm:f'}")

    # When it is loaded
    with pytest.raises(SpecError) as caught:
        load_spec_file(path)

    # Then the error names spec and says the file is not JSON
    [entry] = caught.value.errors
    assert entry["field"] == "spec"
    assert "not valid JSON" in entry["reason"]


def test_a_spec_file_holding_a_list_is_refused(tmp_path) -> None:
    # Given a YAML file holding a list, not a mapping
    path = tmp_path / "job.yaml"
    path.write_text("- entrypoint: m:f\n")

    # When it is loaded
    with pytest.raises(SpecError) as caught:
        load_spec_file(path)

    # Then the error names spec
    assert caught.value.errors[0]["field"] == "spec"
    assert "mapping" in caught.value.errors[0]["reason"]


def test_a_missing_spec_file_is_refused_naming_spec(tmp_path) -> None:
    # Given a path with no file
    path = tmp_path / "absent.yaml"

    # When it is loaded
    with pytest.raises(SpecError) as caught:
        load_spec_file(path)

    # Then the error names spec and the path
    assert caught.value.errors[0]["field"] == "spec"
    assert str(path) in caught.value.errors[0]["reason"]
