"""Tenants' secrets, encrypted at rest with `cryptography`'s Fernet (docs/security.md, "Secrets").

The pool's key is the setting `secrets_key` (`E31_SECRETS_KEY`, or a file through
`E31_SECRETS_KEY_FILE`; `e31 up` makes one in E31_HOME/secrets.key). It may hold several keys,
comma-separated: the first encrypts, every one decrypts, so a key is rotated by putting the new
one first and re-setting the secrets before the old one goes. The store holds only ciphertexts,
each bound to its tenant and name: a ciphertext copied to another tenant's row, or renamed,
does not decrypt there.

A secret's value leaves this module only towards the job's environment: the API stores it,
the worker decrypts it when an attempt starts (the secrets stage, e31_worker.attempt.secrets)
and hands it to the child's environment alone.
"""

from __future__ import annotations

from collections.abc import Mapping

from cryptography.fernet import Fernet, InvalidToken, MultiFernet

from e31.core.errors import SecretsUnavailable, SpecError
from e31.core.names import ENV_NAME, SECRET_NAME_MAX, reserved_env

SECRET_VALUE_MAX_BYTES = 64 * 1024   # an API key or a certificate; bigger data is an input
NO_KEY = ("this pool has no secrets key (set E31_SECRETS_KEY or E31_SECRETS_KEY_FILE to a "
          "Fernet key: python -c 'from cryptography.fernet import Fernet; "
          "print(Fernet.generate_key().decode())'); secrets are off")


def generate_key() -> str:
    """A fresh Fernet key, as text (what `secrets_key` holds)."""
    return Fernet.generate_key().decode()


def check_secret_name(name: str) -> str:
    """`name` if it can be a secret's name: an environment variable's name (the job sees the
    secret as one) that the worker does not set itself; `SpecError` naming `name` otherwise."""
    if not isinstance(name, str) or not ENV_NAME.fullmatch(name) or len(name) > SECRET_NAME_MAX:
        raise SpecError.one("name", f"must be an environment variable's name (letters, digits, "
                                    f"_; not starting with a digit), at most {SECRET_NAME_MAX} "
                                    "characters")
    if reserved_env(name):
        raise SpecError.one("name", f"{name} is set by the worker and cannot be a secret")
    return name


def check_secret_value(value: str) -> str:
    if not isinstance(value, str) or not value:
        raise SpecError.one("value", "must be non-empty text")
    if "\x00" in value:
        raise SpecError.one("value", "must not contain a NUL character (an environment "
                                     "variable cannot hold one)")
    if len(value.encode()) > SECRET_VALUE_MAX_BYTES:
        raise SpecError.one("value", f"larger than {SECRET_VALUE_MAX_BYTES} bytes; pass data "
                                     "as an input instead")
    return value


class SecretBox:
    """Encrypts a tenant's secret for the store and decrypts it for its job."""

    def __init__(self, key: str) -> None:
        keys = [k.strip() for k in key.split(",") if k.strip()]
        if not keys:
            raise SecretsUnavailable(NO_KEY)
        try:
            self._fernet = MultiFernet([Fernet(k.encode()) for k in keys])
        except ValueError as exc:
            raise SecretsUnavailable(f"secrets_key is not a Fernet key (32 url-safe base64 "
                                     f"bytes): {exc}") from None

    @classmethod
    def of(cls, key: str) -> SecretBox | None:
        """The box for `key`, or None when the pool has none (`secrets_key` empty)."""
        return cls(key) if key.strip() else None

    @staticmethod
    def _bound(tenant_id: str, name: str) -> bytes:
        return f"{tenant_id}\x00{name}\x00".encode()

    def encrypt(self, tenant_id: str, name: str, value: str) -> str:
        return self._fernet.encrypt(self._bound(tenant_id, name) + value.encode()).decode()

    def decrypt(self, tenant_id: str, name: str, ciphertext: str) -> str:
        """The value of the tenant's secret; `SecretsUnavailable` when no key decrypts it or
        it was stored for another tenant or name."""
        try:
            plain = self._fernet.decrypt(ciphertext.encode())
        except (InvalidToken, ValueError):
            raise SecretsUnavailable(f"secret {name}: no key of secrets_key decrypts it (was "
                                     "the key changed without re-setting it?)") from None
        bound = self._bound(tenant_id, name)
        if not plain.startswith(bound):
            raise SecretsUnavailable(f"secret {name}: stored for another tenant or name")
        return plain[len(bound):].decode()

    def decrypt_all(self, tenant_id: str, ciphertexts: Mapping[str, str]) -> dict[str, str]:
        return {n: self.decrypt(tenant_id, n, c) for n, c in ciphertexts.items()}

