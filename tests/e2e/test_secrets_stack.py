"""Secrets on a real `e31 up` stack: the key `e31 up` made, `e31 secret` from a shell, and a
sandboxed job that sees its secret while the stack's own logs never hold it."""

from __future__ import annotations

import hashlib
import json
import secrets as random
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from e31.core.errors import ClientError
from e31.edge.secrets import SecretBox
from e31.local.stack import SECRETS_KEY_FILE, secrets_key_path
from tests.e2e.conftest import Stack


def e31_stdin(stack: Stack, stdin: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "e31.cli", *args], env=stack.env, input=stdin,
                          capture_output=True, text=True, timeout=60)


def test_a_secret_set_from_a_shell_reaches_a_sandboxed_job_and_no_log(stack: Stack) -> None:
    value = "hf_" + random.token_hex(16)
    # Given a secret set as a user would, its value on stdin
    set_ = e31_stdin(stack, value + "\n", "secret", "set", "HF_TOKEN")
    assert set_.returncode == 0, set_.stderr
    listed = stack.e31("secret", "list", "--json")
    assert [s["name"] for s in json.loads(listed.stdout)] == ["HF_TOKEN"]
    assert value not in listed.stdout + set_.stdout + set_.stderr

    # When a job names it (run in the stack's sandbox)
    client = stack.client()
    job = client.submit(command=["sh", "-c", 'printf %s "$HF_TOKEN" | sha256sum'],
                        resources={"gpus": 0}, secrets=["HF_TOKEN"])
    status = job.wait(timeout=120)

    # Then it saw the value (its hash is in its log), and no log of the stack holds it
    assert status["state"] == "succeeded", status
    assert status["attempts"][-1].get("isolation") == "sandbox"
    assert hashlib.sha256(value.encode()).hexdigest() in job.logs()
    assert value not in json.dumps(status) + job.logs()
    # and an entrypoint job, forked from the worker's warm process when one is ready (this
    # one was, when written: its attempt recorded start=warm), sees it too
    warm = client.submit(entrypoint="e2ejobs:secret_hash", params={"name": "HF_TOKEN"},
                         resources={"gpus": 0}, secrets=["HF_TOKEN"])
    warm_status = warm.wait(timeout=120)
    assert warm.result() == hashlib.sha256(value.encode()).hexdigest()
    assert warm_status["attempts"][-1].get("start") in ("warm", "cold")
    assert value not in json.dumps(warm_status) + warm.logs()
    for log in (stack.home / "logs").glob("*"):
        assert value.encode() not in log.read_bytes(), log.name

    # and the pool's key is a Fernet key in a file of the stack's home, mode 0600
    key = stack.home / SECRETS_KEY_FILE
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    SecretBox(key.read_text().strip())   # a Fernet key
    deleted = stack.e31("secret", "delete", "HF_TOKEN")
    assert deleted.returncode == 0 and "HF_TOKEN deleted" in deleted.stdout


def test_the_secret_commands_refuse_bad_input_with_exit_2(stack: Stack) -> None:
    empty = e31_stdin(stack, "", "secret", "set", "EMPTY")
    assert empty.returncode == 2 and "no value on stdin" in empty.stderr
    missing = stack.e31("secret", "delete", "NEVER_SET")
    assert missing.returncode == 2 and "NEVER_SET" in missing.stderr
    with pytest.raises(ClientError) as refused:
        stack.client().submit(command=["true"], resources={"gpus": 0}, secrets=["NEVER_SET"])
    assert refused.value.status_code == 409 and "NEVER_SET" in refused.value.message


def test_e31_up_makes_the_key_once_and_keeps_it(tmp_path: Path) -> None:
    first = secrets_key_path(tmp_path).read_text()
    assert secrets_key_path(tmp_path).read_text() == first
    assert stat.S_IMODE((tmp_path / SECRETS_KEY_FILE).stat().st_mode) == 0o600
