"""Sweep files into array items, and defaults merged under each item (`e31.ops.sweep`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from e31.core.errors import SpecError
from e31.ops.sweep import MAX_ARRAY_ITEMS, is_sweep, load_sweep_file, merge_item, parse_sweep


def field_of(exc: pytest.ExceptionInfo[SpecError]) -> str:
    return exc.value.errors[0]["field"]


def test_a_grid_is_every_combination_with_the_first_key_slowest() -> None:
    # Given a grid of two params with two values each
    data = {"grid": {"lr": [0.1, 0.01], "bs": [32, 64]}}

    # When it is parsed
    sweep = parse_sweep(data)

    # Then it has the four combinations in a fixed order
    assert sweep.params == [{"lr": 0.1, "bs": 32}, {"lr": 0.1, "bs": 64},
                            {"lr": 0.01, "bs": 32}, {"lr": 0.01, "bs": 64}]
    assert sweep.items()[3] == {"params": {"lr": 0.01, "bs": 64}}
    assert sweep.base == {}


def test_a_list_is_one_item_per_entry_in_order() -> None:
    sweep = parse_sweep({"list": [{"lr": 0.1}, {"lr": 0.2, "warmup": True}, {}]})
    assert sweep.params == [{"lr": 0.1}, {"lr": 0.2, "warmup": True}, {}]


def test_a_sweep_may_carry_its_base_spec() -> None:
    # Given a sweep file with a base spec
    data = {"base": {"entrypoint": "m:f", "params": {"epochs": 1}}, "list": [{"lr": 0.1}]}

    # When it is parsed
    sweep = parse_sweep(data)

    # Then the base is kept apart from the items
    assert sweep.base == {"entrypoint": "m:f", "params": {"epochs": 1}}
    assert sweep.items() == [{"params": {"lr": 0.1}}]


@pytest.mark.parametrize("data, field", [
    ({}, "sweep"),
    ({"grid": {"a": [1]}, "list": [{}]}, "sweep"),
    ({"grid": {"a": [1]}, "colour": "red"}, "sweep.colour"),
    ({"grid": {}}, "sweep.grid"),
    ({"grid": [1, 2]}, "sweep.grid"),
    ({"grid": {"lr": 0.1}}, "sweep.grid.lr"),
    ({"grid": {"lr": []}}, "sweep.grid.lr"),
    ({"grid": {1: [1, 2]}}, "sweep.grid.1"),
    ({"list": []}, "sweep.list"),
    ({"list": {"lr": 0.1}}, "sweep.list"),
    ({"list": [{"lr": 0.1}, 5]}, "sweep.list[1]"),
    ({"list": [{2: 0.1}]}, "sweep.list[0].2"),
    ({"list": [{}], "base": [1]}, "sweep.base"),
    ("grid", "sweep"),
])
def test_a_bad_sweep_is_refused_naming_the_field(data: object, field: str) -> None:
    # Given a malformed sweep
    # When it is parsed
    with pytest.raises(SpecError) as exc:
        parse_sweep(data)

    # Then the error names the field and says why
    assert field_of(exc) == field
    assert exc.value.errors[0]["reason"]


def test_a_grid_too_big_for_one_array_is_refused_before_it_is_expanded() -> None:
    # Given a grid of 10^12 combinations (expanding it would never finish)
    data = {"grid": {f"p{i}": list(range(10)) for i in range(12)}}

    # When it is parsed
    with pytest.raises(SpecError) as exc:
        parse_sweep(data)

    # Then it is refused at once with the count and the cap
    assert field_of(exc) == "sweep.grid"
    assert str(MAX_ARRAY_ITEMS) in exc.value.errors[0]["reason"]


def test_a_list_longer_than_the_cap_is_refused() -> None:
    with pytest.raises(SpecError) as exc:
        parse_sweep({"list": [{}] * 3}, max_items=2)
    assert field_of(exc) == "sweep.list" and "at most 2" in exc.value.errors[0]["reason"]


def test_a_sweep_file_is_told_apart_from_a_job_spec() -> None:
    assert is_sweep({"grid": {"a": [1]}})
    assert is_sweep({"list": [{}], "base": {}})
    assert not is_sweep({"entrypoint": "m:f", "params": {"grid": 1}})


def test_a_sweep_file_is_read_from_yaml_or_json(tmp_path: Path) -> None:
    # Given the same sweep as YAML and as JSON
    yaml_file = tmp_path / "s.yaml"
    yaml_file.write_text("grid:\n  lr: [0.1, 0.2]\n")
    json_file = tmp_path / "s.json"
    json_file.write_text('{"list": [{"lr": 0.1}, {"lr": 0.2}]}')

    # When both are loaded
    # Then they give the same items
    assert load_sweep_file(yaml_file).params == load_sweep_file(json_file).params


def test_an_unreadable_sweep_file_names_the_sweep(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("grid: [unclosed\n")
    for path in (bad, tmp_path / "missing.yaml"):
        with pytest.raises(SpecError) as exc:
            load_sweep_file(path)
        assert field_of(exc) == "sweep"


def test_an_item_wins_over_the_defaults_and_params_and_env_merge_key_by_key() -> None:
    # Given defaults and an item that overrides some of them
    defaults = {"entrypoint": "m:f", "priority": 3, "params": {"epochs": 3, "lr": 0.1},
                "env": {"A": "1"}, "resources": {"gpus": 1, "gpu_mem_gb": 40}}
    item = {"priority": 7, "params": {"lr": 0.01}, "env": {"B": "2"}, "resources": {"gpus": 0}}

    # When the item is merged over the defaults
    merged = merge_item(defaults, item)

    # Then the item's fields win, params and env are merged, other fields are replaced whole
    assert merged == {"entrypoint": "m:f", "priority": 7, "params": {"epochs": 3, "lr": 0.01},
                      "env": {"A": "1", "B": "2"}, "resources": {"gpus": 0}}
    assert defaults["params"] == {"epochs": 3, "lr": 0.1}   # the defaults are not changed


def test_an_item_that_is_not_a_mapping_is_left_for_validation_to_name() -> None:
    assert merge_item({"entrypoint": "m:f"}, 5) == 5
