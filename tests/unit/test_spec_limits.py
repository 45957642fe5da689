"""Strict types, names without control characters, and the caps on what a request carries
(`SpecLimits`, `RequestTally`). Each refusal is shown beside the same input getting through
when the check is switched off, so the test would catch the hole it closes."""

from __future__ import annotations

from typing import Any

import pytest

from e31.api.requestlimits import spec_limits
from e31.core import spec as spec_module
from e31.core.errors import SpecError
from e31.core.names import printable
from e31.core.requestlimits import RequestTally, SpecLimits, argv_bytes, env_bytes, spec_bytes
from e31.core.spec import JobSpec
from e31.edge.settings import Settings

BASE: dict[str, Any] = {"entrypoint": "m:f"}
LIMITS = SpecLimits(env_vars=3, env_bytes=40, argv_bytes=20, after_per_request=5,
                    spec_bytes_per_request=200)
JOB_A, JOB_B, JOB_C = "j-" + "a" * 20, "j-" + "b" * 20, "j-" + "c" * 20


def fields(path: str, value: Any) -> dict[str, Any]:
    """A spec with `value` at `path` (`resources.gpus`)."""
    head, _, tail = path.partition(".")
    return {**BASE, head: {tail: value}} if tail else {**BASE, head: value}


def refused_field(data: dict[str, Any]) -> list[str]:
    with pytest.raises(SpecError) as caught:
        JobSpec.parse(data)
    return [e["field"] for e in caught.value.errors]


# Every number of the spec, with what lax validation would have taken for it.
LAX_NUMBERS = [
    ("priority", True), ("priority", "9"),
    ("timeout_s", True), ("timeout_s", "60"),
    ("resources.gpus", True), ("resources.gpus", "1"),
    ("resources.gpu_mem_gb", True), ("resources.gpu_mem_gb", "40"),
    ("resources.mem_gb", True), ("resources.mem_gb", "8"),
    ("retries.max", True), ("retries.max", "2"),
    ("retries.backoff_s", True), ("retries.backoff_s", "1.5"),
    ("retries.backoff_max_s", "60"), ("retries.max_lost", True), ("retries.max_lost", "3"),
]


@pytest.mark.parametrize("path, value", LAX_NUMBERS)
def test_a_boolean_or_a_string_is_no_number_and_a_float_is_no_integer(path: str,
                                                                       value: Any) -> None:
    # Given a spec whose number is a boolean or a numeric string
    data = fields(path, value)

    # Then it is refused naming that field
    assert refused_field(data) == [path]
    # and lax validation (the hole) would have taken it
    JobSpec.model_validate(data, strict=False)


@pytest.mark.parametrize("path", ["timeout_s", "resources.gpu_mem_gb", "resources.mem_gb",
                                  "retries.backoff_s", "retries.backoff_max_s"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_number_that_is_not_finite_is_refused(path: str, value: float) -> None:
    assert refused_field(fields(path, value)) == [path]


def test_a_whole_number_still_stands_for_a_float_and_valid_specs_read_as_before() -> None:
    spec = JobSpec.parse({"command": ["python", "train.py"], "timeout_s": 60, "priority": 9,
                          "resources": {"gpus": 2, "gpu_mem_gb": 40, "mem_gb": 8},
                          "retries": {"max": 2, "backoff_s": 1, "backoff_max_s": 60}})
    assert (spec.timeout_s, spec.priority, spec.resources.gpu_mem_gb, spec.retries.backoff_s) \
        == (60.0, 9, 40.0, 1.0)
    assert isinstance(spec.timeout_s, float) and isinstance(spec.priority, int)
    # and a float without a fraction is an integer, as JSON Schema counts it; 2.5 is none
    whole = JobSpec.parse({"command": ["true"], "priority": 9.0, "retries": {"max": 2.0}})
    assert (whole.priority, whole.retries.max) == (9, 2) and isinstance(whole.priority, int)
    assert refused_field(fields("priority", 2.5)) == ["priority"]


def test_a_list_of_text_and_a_mapping_of_text_take_no_other_types() -> None:
    assert refused_field({"command": ["sleep", 5]}) == ["command.1"]
    assert refused_field({**BASE, "env": {"A": 1}}) == ["env.A"]
    assert refused_field({**BASE, "after": [5]}) == ["after.0"]
    assert refused_field({**BASE, "name": 5}) == ["name"]


FORGED = "train\n2026-01-01 00:00:00 e31_worker INFO job_succeeded job=j-FORGED"


@pytest.mark.parametrize("name", [FORGED, "a\rb", "colour\x1b[31m", "del\x7f", "c1\x85",
                                  "line\u2028sep", "para\u2029sep", "tab\there", "nul\x00"])
def test_a_name_with_a_control_character_is_refused(name: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a job name that holds a control character (a newline forges a log line)
    data = {**BASE, "name": name}

    # Then it is refused naming the field
    assert refused_field(data) == ["name"]

    # and without the check (the hole) the same spec is taken
    if "\x00" not in name:   # NUL had its own check before this one
        monkeypatch.setattr(spec_module, "check_name", lambda value, what="": value)
        assert JobSpec.parse(data).name == name


@pytest.mark.parametrize("name", ["café au lait", "训练 run 3", "sweep 🚀 [12]", "a b", "x" * 200])
def test_a_name_in_any_script_with_spaces_and_symbols_is_taken(name: str) -> None:
    assert JobSpec.parse({**BASE, "name": name}).name == name


def test_printable_escapes_control_characters_and_leaves_text_alone() -> None:
    assert printable("team-a/train") == "team-a/train"
    assert printable("café 🚀") == "café 🚀"
    assert printable(FORGED) == FORGED.replace("\n", "\\n")
    assert "\n" not in printable(FORGED) and "\x1b" not in printable("a\x1b[31mb")
    assert printable("a\u2028b\x85c") == "a\\u2028b\\x85c"


@pytest.mark.parametrize("where", ["env", "command"])
def test_a_lone_surrogate_in_an_argument_or_variable_is_refused(where: str) -> None:
    data = {**BASE, "env": {"A": "\ud800"}} if where == "env" \
        else {"command": ["echo", "\udfff"]}
    assert refused_field(data) == [where]


def test_the_sizes_count_what_a_process_holds() -> None:
    assert env_bytes({"A": "b", "NAME": "é"}) == len("A=b\0") + len("NAME=\xc3\xa9\0")
    assert argv_bytes(["ls", "-l"]) == len("ls\0-l\0")
    spec = JobSpec.parse({**BASE, "name": "n", "env": {"A": "b"}, "params": {"x": 1}})
    assert spec_bytes(spec) == 1 + 4 + len('{"x": 1}')


def test_env_is_capped_by_count_and_by_bytes_per_job() -> None:
    at_cap = JobSpec.parse({**BASE, "env": {"A": "1", "B": "2", "C": "3"}})
    assert LIMITS.check(at_cap) == []
    too_many = JobSpec.parse({**BASE, "env": {"A": "1", "B": "2", "C": "3", "D": "4"}})
    assert [e["field"] for e in LIMITS.check(too_many)] == ["env"]
    assert "max_env_vars" in LIMITS.check(too_many)[0]["reason"]
    too_big = JobSpec.parse({**BASE, "env": {"A": "x" * 38}})      # A= x*38 NUL: 41 bytes
    assert [e["field"] for e in LIMITS.check(too_big)] == ["env"]
    assert "max_env_bytes" in LIMITS.check(too_big)[0]["reason"]
    assert LIMITS.check(JobSpec.parse({**BASE, "env": {"A": "x" * 37}})) == []


def test_argv_is_capped_in_bytes_per_job() -> None:
    assert LIMITS.check(JobSpec.parse({"command": ["x" * 19]})) == []
    over = LIMITS.check(JobSpec.parse({"command": ["x" * 19, ""]}))
    assert [e["field"] for e in over] == ["command"] and "max_argv_bytes" in over[0]["reason"]


def test_after_is_capped_over_all_the_jobs_of_a_request() -> None:
    # Given a request whose jobs name 3 + 3 dependencies against a cap of 5 per request
    tally = RequestTally(LIMITS, field="items")
    tally.add(JobSpec.parse({**BASE, "after": [JOB_A, JOB_B, JOB_C]}))

    # Then the job that passes the total is refused, naming the request's items and the cap
    with pytest.raises(SpecError) as caught:
        tally.add(JobSpec.parse({**BASE, "after": [JOB_A, JOB_B, JOB_C]}))
    [error] = caught.value.errors
    assert error["field"] == "items" and "max_after_per_request" in error["reason"]

    # while each job alone is within the per-job cap of 64 (the hole: caps per job only)
    roomy = RequestTally(SpecLimits(**{**vars(LIMITS), "after_per_request": 6}))
    for _ in range(2):
        roomy.add(JobSpec.parse({**BASE, "after": [JOB_A, JOB_B, JOB_C]}))
    assert roomy.after == 6


def test_names_env_argv_and_params_are_capped_in_bytes_over_a_request() -> None:
    # Given jobs of 100 bytes of params each, against 200 bytes per request
    job = JobSpec.parse({**BASE, "params": {"p": "x" * 91}})
    assert spec_bytes(job) == 100
    tally = RequestTally(LIMITS)
    tally.add(job)
    tally.add(job)

    # Then the third is refused; a single job names the spec
    with pytest.raises(SpecError) as caught:
        tally.add(job)
    assert caught.value.errors[0]["field"] == "spec"
    assert "max_spec_bytes_per_request" in caught.value.errors[0]["reason"]


def test_the_limits_come_from_the_settings_each_by_its_name() -> None:
    settings = Settings(max_env_vars=1, max_env_bytes=2, max_argv_bytes=3,
                        max_after_per_request=4, max_spec_bytes_per_request=5000)
    assert spec_limits(settings) == SpecLimits(env_vars=1, env_bytes=2, argv_bytes=3,
                                               after_per_request=4, spec_bytes_per_request=5000,
                                               disk_gb=settings.attempt_disk_max_gb)
    defaults = Settings()
    assert (defaults.max_request_bytes, defaults.max_env_vars, defaults.max_env_bytes,
            defaults.max_argv_bytes, defaults.max_after_per_request,
            defaults.max_spec_bytes_per_request) == (16 << 20, 256, 64 << 10, 128 << 10,
                                                     10_000, 32 << 20)
