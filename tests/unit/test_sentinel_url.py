"""`sentinel://` Redis URLs: what each process takes from them (tests/integration/test_failover
runs a real Sentinel failover)."""

from __future__ import annotations

import pytest

from e31.edge.celeryapp import broker_transport_options
from e31.edge.settings import Settings
from e31.edge.wiring import is_sentinel, sentinel_parts

URL = "sentinel://:p%40ss@h1:26379;sentinel://h2:26380;sentinel://h3/2"


def test_a_sentinel_url_names_every_sentinel_the_database_and_the_primarys_password() -> None:
    assert is_sentinel(URL) and not is_sentinel("redis://h:6379/0")
    assert sentinel_parts(URL) == ([("h1", 26379), ("h2", 26380), ("h3", 26379)], 2, "p@ss")


def test_a_part_that_is_not_a_sentinel_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="redis://h2"):
        sentinel_parts("sentinel://h1:26379;redis://h2:6379")


def test_the_broker_asks_sentinel_for_the_named_primary_and_only_with_sentinel() -> None:
    sentinel = Settings(redis_url=URL, redis_master_name="pool")
    assert broker_transport_options(sentinel)["master_name"] == "pool"
    assert "master_name" not in broker_transport_options(Settings(redis_url="redis://h:6379/0"))
