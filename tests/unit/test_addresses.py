"""The address policy of http(s) inputs (e31.core.addresses): public addresses pass; loopback,
link-local, private, unspecified, multicast and reserved ones are refused, in IPv4, IPv6 and
an IPv6 form that carries an IPv4 address, unless an operator's allowed network holds them."""

from __future__ import annotations

import pytest

from e31.core.addresses import refusal, url_refusal


@pytest.mark.parametrize(("address", "why"), [
    ("127.0.0.1", "a loopback address"),
    ("127.255.255.254", "a loopback address"),
    ("::1", "a loopback address"),
    ("169.254.169.254", "a link-local address"),
    ("fe80::1", "a link-local address"),
    ("fe80::1%eth0", "a link-local address"),
    ("10.1.2.3", "a private address"),
    ("172.16.0.1", "a private address"),
    ("192.168.1.1", "a private address"),
    ("fd00::1", "a private address"),
    ("0.0.0.0", "an unspecified address"),
    ("::", "an unspecified address"),
    ("224.0.0.1", "a multicast address"),
    ("ff02::1", "a multicast address"),
    ("240.0.0.1", "a reserved address"),
    ("100.100.100.200", "not a public address"),     # shared address space (a metadata server)
    ("fec0::1", "a site-local address"),
])
def test_an_address_that_is_not_public_is_refused_naming_its_kind(address: str, why: str) -> None:
    assert refusal(address, ()) == why


@pytest.mark.parametrize(("address", "why"), [
    ("::ffff:127.0.0.1", "a loopback address"),         # IPv4-mapped
    ("::ffff:169.254.169.254", "a link-local address"),
    ("64:ff9b::a9fe:a9fe", "a link-local address"),     # NAT64 of 169.254.169.254
    ("2002:7f00:1::", "a loopback address"),            # 6to4 of 127.0.0.1
    ("::ffff:0.0.0.0", "an unspecified address"),
])
def test_an_ipv6_address_carrying_an_ipv4_one_is_judged_by_the_ipv4_one(address: str,
                                                                       why: str) -> None:
    assert refusal(address, ()) == why


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111",
                                     "::ffff:8.8.8.8"])
def test_a_public_address_is_allowed(address: str) -> None:
    assert refusal(address, ()) is None


def test_an_allowed_network_lets_its_addresses_through_and_no_other() -> None:
    # Given an operator who allows the loopback network and one private subnet
    allowed = ("127.0.0.0/8", "10.20.0.0/16")

    # Then those addresses pass, a mapped form of one too, and nothing beside them
    assert refusal("127.0.0.2", allowed) is None
    assert refusal("::ffff:127.0.0.1", allowed) is None
    assert refusal("10.20.3.4", allowed) is None
    assert refusal("10.21.0.1", allowed) == "a private address"
    assert refusal("169.254.169.254", allowed) == "a link-local address"
    assert refusal("::1", allowed) == "a loopback address"
    assert refusal("::1", ("::1/128",)) is None


@pytest.mark.parametrize("url", [
    "http://127.0.0.1/x", "http://[::1]/", "http://localhost/", "http://LOCALHOST./",
    "http://app.localhost:8080/", "http://169.254.169.254/latest/meta-data/",
    "https://10.0.0.5/data.csv", "http://[::ffff:127.0.0.1]:5555/metrics",
    "http://127.1/", "http://2130706433/", "http://0x7f.1/", "http://0/",
    "http://[fe80::1%25eth0]/",
])
def test_a_url_whose_text_shows_a_refused_host_is_refused_naming_it(url: str) -> None:
    why = url_refusal(url, ())
    assert why is not None and why.startswith("its host ")
    assert "input_allowed_networks" in why


@pytest.mark.parametrize("url", ["https://example.com/data.csv", "http://8.8.8.8/x",
                                 "https://[2606:4700:4700::1111]/"])
def test_a_url_with_a_public_or_named_host_passes_the_text_check(url: str) -> None:
    # (a name is resolved, and its addresses checked, by the worker when it connects)
    assert url_refusal(url, ()) is None


def test_a_url_of_an_allowed_network_passes_the_text_check() -> None:
    assert url_refusal("http://127.0.0.1:8000/x", ("127.0.0.0/8",)) is None
    assert url_refusal("http://localhost/", ("127.0.0.0/8",)) is None
    assert url_refusal("http://169.254.169.254/", ("127.0.0.0/8",)) is not None
