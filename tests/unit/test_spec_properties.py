"""Property tests of spec parsing (hypothesis): whatever arrives — JSON-like values, mappings
with the real field names and random values (NaN, infinities, huge integers, wrong types, odd
unicode, lone surrogates, NUL) — `JobSpec.parse` either parses it or raises `SpecError` whose
every entry names a field and a reason; nothing else escapes. A parsed spec round-trips through
the JSON the store keeps: parse(dump(spec)) == spec.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from e31.core.errors import SpecError
from e31.core.spec import JobSpec

# Examples per property: a few seconds each in CI; a longer hunt: E31_SPEC_EXAMPLES=20000.
EXAMPLES = int(os.environ.get("E31_SPEC_EXAMPLES", "150"))
PROFILE = settings(max_examples=EXAMPLES, deadline=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# Text with every kind of character: controls, NUL, lone surrogates, line separators, emoji.
odd_text = st.text(alphabet=st.characters(codec=None, categories=None), max_size=24)
scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(), st.integers(min_value=-(10 ** 40), max_value=10 ** 40),
    st.floats(allow_nan=True, allow_infinity=True),
    odd_text, st.sampled_from(["", "0", "9", "1e309", "NaN", "true", "m:f", "sha256:", "E31_X"]))
json_like = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(odd_text, inner, max_size=4)), max_leaves=12)

# Values near what each field takes, so that many examples parse and the round trip is tried.
names = st.one_of(st.from_regex(r"\A[A-Za-z_][A-Za-z0-9_]{0,12}\Z"), odd_text)
numbers = st.one_of(st.integers(-2, 20), st.floats(-1, 1e6), st.sampled_from([0.5, 2.0, 1e309]))
dep_ids = st.one_of(st.from_regex(r"\A[ja]-[0-9a-f]{20}\Z"), odd_text)
near = {
    "name": st.one_of(odd_text, st.just("train")),
    "entrypoint": st.one_of(st.sampled_from(["m:f", "pkg.mod:main", "m", ":f"]), odd_text),
    "command": st.lists(odd_text, max_size=3),
    "params": st.dictionaries(odd_text, json_like, max_size=3),
    "env": st.dictionaries(names, odd_text, max_size=3),
    "resources": st.fixed_dictionaries({}, optional={
        "gpus": numbers, "gpu_mem_gb": numbers, "size_class": odd_text, "mem_gb": numbers}),
    "timeout_s": numbers,
    "retries": st.fixed_dictionaries({}, optional={
        "max": numbers, "backoff_s": numbers, "backoff_max_s": numbers, "max_lost": numbers}),
    "priority": numbers,
    "workload": st.sampled_from(["train", "batch-inference", "footage", "nope"]),
    "after": st.lists(dep_ids, max_size=3),
    "python": st.fixed_dictionaries({}, optional={
        "pip": st.lists(st.sampled_from(["numpy", "torch==2.1", "bad req", "x[y]>=1"]),
                        max_size=3),
        "requirements": st.sampled_from(["requirements.txt", "../x", "/abs"])}),
    "code": st.one_of(st.from_regex(r"\Asha256:[0-9a-f]{64}\Z"), odd_text),
    "inputs": st.dictionaries(names, st.sampled_from(
        ["s3://b/k", "https://h/x", "file:///data/x", "bundle:sha256:" + "0" * 64 + "/a", "x"]),
        max_size=2),
    "network": st.sampled_from(["none", "host", None]),
    "idle_timeout_s": numbers,
    "on_idle": st.sampled_from(["flag", "kill", "stop"]),
    "secrets": st.lists(names, max_size=3),
}
field_values = {k: st.one_of(v, json_like) for k, v in near.items()}
spec_like = st.fixed_dictionaries({}, optional=field_values)
kind = st.sampled_from([{"entrypoint": "m:f"}, {"command": ["python", "x.py"]}, {}])
specs = st.builds(lambda base, fields: {**base, **fields}, kind, spec_like)
anything = st.one_of(json_like, specs, st.dictionaries(odd_text, json_like, max_size=4))


def parse_or_refuse(data: Any) -> JobSpec | None:
    """The spec, or None when refused with a well-formed `SpecError`; anything else fails."""
    try:
        return JobSpec.parse(data)
    except SpecError as exc:
        assert exc.errors, "a refusal names at least one field"
        for error in exc.errors:
            assert isinstance(error["field"], str) and error["field"]
            assert isinstance(error["reason"], str) and error["reason"]
        return None


def stored(spec: JobSpec) -> Any:
    """The spec as the store keeps it: its JSON dump, through JSON text."""
    return json.loads(json.dumps(spec.model_dump(mode="json"), allow_nan=False))


@PROFILE
@given(anything)
def test_any_input_parses_or_is_refused_with_the_spec_error(data: Any) -> None:
    parse_or_refuse(data)


@PROFILE
@given(specs)
def test_a_parsed_spec_round_trips_through_what_the_store_keeps(data: dict[str, Any]) -> None:
    spec = parse_or_refuse(data)
    if spec is None:
        return
    again = JobSpec.parse(stored(spec))
    # `workload` is an alias of its entrypoint and not stored: the entrypoint stands for it.
    assert again == spec.model_copy(update={"workload": None})
    assert stored(again) == stored(spec)
    assert all(math.isfinite(v) for v in (again.timeout_s, again.retries.backoff_s))


def test_the_strategies_reach_both_outcomes() -> None:
    # The properties above are only as good as their inputs: many of them parse, many do not.
    # Derandomized, a fixed sequence of 200: random runs of 80 came out at times at the bound
    # (4 of 80 parsed), failing the suite for the luck of the draw.
    outcomes: list[bool] = []

    @settings(max_examples=200, deadline=None, database=None, derandomize=True)
    @given(specs)
    def collect(data: dict[str, Any]) -> None:
        outcomes.append(parse_or_refuse(data) is not None)

    collect()
    assert 0.05 < sum(outcomes) / len(outcomes) < 0.95, sum(outcomes)
