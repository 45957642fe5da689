"""The secrets stage: the job's secrets, resolved when its attempt starts (docs/security.md,
"Secrets").

The spec carries only names (`secrets: [HF_TOKEN]`); here, during the attempt's setup, the
worker reads the job's tenant's ciphertexts from the store and decrypts them with the pool's
key. The values go into the attempt's plan (`AttemptPlan.secret_env`, never printed) and from
there into the child's environment only: not into the claim file, job.json, a log line or the
store. Resolving at each attempt's start means a secret changed or deleted while the job is
queued takes effect at its next attempt; a secret deleted meanwhile, or a pool without a key,
fails the attempt with reason `setup` (no retry), saying which name.
"""

from __future__ import annotations

import dataclasses

from e31.core.errors import SecretsUnavailable, SetupError
from e31.core.records import Claim
from e31.edge.secrets import NO_KEY, SecretBox
from e31_worker.attempt.services import AttemptServices
from e31_worker.attempt.stages import Attempt, Stage


class SecretsStage(Stage):
    """The secrets stage: the job's secrets, decrypted into its plan (`secret_env`)."""

    def setup(self, attempt: Attempt) -> None:
        attempt.plan = dataclasses.replace(attempt.plan,
                                           secret_env=secret_env(attempt.svc, attempt.claim))


def secret_env(svc: AttemptServices, claim: Claim) -> dict[str, str]:
    """The job's secrets by name, decrypted; {} for a job that names none."""
    names = claim.spec.secrets
    if not names:
        return {}
    try:
        box = SecretBox.of(svc.settings.secrets_key)
    except SecretsUnavailable as exc:
        raise SetupError(f"secrets: {exc}") from None
    if box is None:
        raise SetupError(f"secrets: this worker has no secrets key: {NO_KEY}")
    found = svc.repo.secret_ciphertexts(claim.tenant_id, names)
    missing = [n for n in names if n not in found]
    if missing:
        raise SetupError(f"secrets: {', '.join(missing)} not set for this job's tenant (deleted "
                         "after the job was submitted?)")
    try:
        return box.decrypt_all(claim.tenant_id, found)
    except SecretsUnavailable as exc:
        raise SetupError(f"secrets: {exc}") from None
