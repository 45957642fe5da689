"""The secrets' encryption (e31.edge.secrets): a ciphertext opens only with the pool's key and only
as the secret of the tenant and name it was stored for, and a key is rotated without loss."""

from __future__ import annotations

import pytest
from cryptography.fernet import Fernet

from e31.core.errors import SecretsUnavailable, SpecError
from e31.edge.secrets import SecretBox, check_secret_name, check_secret_value, generate_key


def test_a_ciphertext_moved_to_another_tenant_or_name_does_not_open() -> None:
    # Given tenant a's secret as the store holds it
    key = generate_key()
    box = SecretBox(key)
    stored = box.encrypt("t-a", "HF_TOKEN", "hf_value")

    # When someone with write access to the store copies it to tenant b's row, or renames it
    # Then it does not open there
    assert box.decrypt("t-a", "HF_TOKEN", stored) == "hf_value"
    for tenant, name in (("t-b", "HF_TOKEN"), ("t-a", "OTHER")):
        with pytest.raises(SecretsUnavailable, match="another tenant or name"):
            box.decrypt(tenant, name, stored)
    # whereas Fernet alone, without the binding, would hand b the value
    assert b"hf_value" in Fernet(key.encode()).decrypt(stored.encode())


def test_a_key_is_rotated_by_putting_the_new_one_first() -> None:
    old, new = generate_key(), generate_key()
    stored = SecretBox(old).encrypt("t", "A", "v")

    rotated = SecretBox(f"{new},{old}")

    assert rotated.decrypt("t", "A", stored) == "v"
    assert SecretBox(new).decrypt("t", "A", rotated.encrypt("t", "A", "v")) == "v"
    with pytest.raises(SecretsUnavailable, match="no key"):
        SecretBox(new).decrypt("t", "A", stored)


def test_no_key_or_a_bad_key_says_so() -> None:
    assert SecretBox.of("") is None
    with pytest.raises(SecretsUnavailable, match="not a Fernet key"):
        SecretBox("not-a-key")


@pytest.mark.parametrize("name", ["", "1X", "A-B", "E31_X", "CUDA_VISIBLE_DEVICES", "A" * 101])
def test_a_secret_name_is_a_variable_name_the_worker_does_not_set(name: str) -> None:
    with pytest.raises(SpecError):
        check_secret_name(name)


@pytest.mark.parametrize("value", ["", "a\x00b", "x" * (64 * 1024 + 1)])
def test_a_secret_value_is_text_a_process_can_hold(value: str) -> None:
    with pytest.raises(SpecError) as refused:
        check_secret_value(value)
    assert refused.value.errors[0]["field"] == "value"
