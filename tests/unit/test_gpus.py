"""GPU discovery's pure parts: `--simulate-gpus` text and `--gpus` selection."""

from __future__ import annotations

import pytest

from e31.core.errors import ConfigError
from e31_worker.node.gpus import Gpu, parse_simulated, select


def test_simulated_gpus_are_indexed_in_the_order_listed_with_their_memory() -> None:
    # Given two 24 GB GPUs and one 80 GB GPU
    # When the text is parsed
    gpus = parse_simulated("2x24,1x80")

    # Then they are GPUs 0, 1 and 2 with those memories
    assert [(g.index, g.mem_gb) for g in gpus] == [(0, 24.0), (1, 24.0), (2, 80.0)]
    assert all(g.name == "simulated" for g in gpus)


def test_simulated_gpus_accept_spaces_fractions_and_a_trailing_comma() -> None:
    # Given a loosely written list with a fractional size
    # When it is parsed
    gpus = parse_simulated(" 1x140.4 , 1x23.99,")

    # Then both GPUs are there with their exact memory
    assert [(g.index, g.mem_gb) for g in gpus] == [(0, 140.4), (1, 23.99)]


@pytest.mark.parametrize("text", ["", ",", "24", "x24", "2x", "0x24", "2*24", "twoX24", "2x24,abc",
                                  "-1x24"])
def test_simulated_gpus_in_a_bad_form_are_a_config_error(text: str) -> None:
    # Given text that is not COUNTxGB[,COUNTxGB...]
    # When it is parsed
    # Then it is refused, naming the flag
    with pytest.raises(ConfigError, match="--simulate-gpus"):
        parse_simulated(text)


GPUS = [Gpu(index=0, mem_gb=24), Gpu(index=1, mem_gb=24), Gpu(index=2, mem_gb=80)]


def test_select_all_keeps_every_gpu() -> None:
    assert select(GPUS, "all") == GPUS


def test_select_a_list_keeps_those_gpus_in_that_order() -> None:
    # Given GPUs 0, 1 and 2
    # When 0 and 2 are selected
    chosen = select(GPUS, "0,2")

    # Then exactly those are kept
    assert [g.index for g in chosen] == [0, 2]


def test_select_a_range_includes_both_ends() -> None:
    # Given GPUs 0, 1 and 2
    # When the range 0-1 is selected
    chosen = select(GPUS, "0-1")

    # Then GPUs 0 and 1 are kept
    assert [g.index for g in chosen] == [0, 1]


def test_select_mixes_lists_and_ranges() -> None:
    assert [g.index for g in select(GPUS, "2, 0-1")] == [2, 0, 1]


def test_selecting_a_gpu_the_machine_lacks_is_a_config_error_naming_it() -> None:
    # Given GPUs 0, 1 and 2
    # When GPU 5 is selected
    with pytest.raises(ConfigError) as caught:
        select(GPUS, "0,5")

    # Then the error names the missing index and what exists
    assert "no GPU 5" in caught.value.message
    assert "[0, 1, 2]" in caught.value.message


@pytest.mark.parametrize("which", ["zero", "0-x", "1.5"])
def test_selecting_something_that_is_not_an_index_is_a_config_error(which: str) -> None:
    with pytest.raises(ConfigError, match="--gpus"):
        select(GPUS, which)


def test_selecting_the_same_gpu_twice_does_not_pin_two_workers_to_it() -> None:
    # Given GPUs 0, 1 and 2
    # When GPU 0 is named twice
    try:
        chosen = select(GPUS, "0,0-1")
    except ConfigError:
        return  # refusing is fine too

    # Then each GPU appears at most once
    indexes = [g.index for g in chosen]
    assert len(indexes) == len(set(indexes))
