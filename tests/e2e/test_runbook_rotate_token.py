"""docs/runbooks/rotate-a-token.md, run as written against a real `e31 up`: a leaked token is
replaced and revoked while a job submitted with it runs, and no job is lost.

The leaked token (named `laptop`, as on the page) submits a job that runs until the test
releases it; the page's embedded-stack blocks then make a new token, switch the client to
it, revoke the leaked one and check it is refused. The job, which holds no token, then ends
and is read with the new token. Before the revocation the leaked token is served: the
refusal after it is the revocation's doing.
"""

from __future__ import annotations

import json
from pathlib import Path

from e31.client import Client
from e31.client.admin import Tenancy
from e31.core.errors import ClientError
from tests.conftest import wait_for
from tests.docblocks import doc, run_command

from .conftest import Stack

PAGE = "docs/runbooks/rotate-a-token.md"
WAIT_S = 90


def test_a_leaked_token_is_rotated_as_the_runbook_says_and_no_job_is_lost(
        stack: Stack, shared_tmp: Path, tmp_path: Path) -> None:
    # Given a token named laptop that leaked, which submitted a job that is running
    profile = stack.home / "profile.json"
    before = profile.read_text()
    made = stack.e31("token", "create", "laptop", "--json")
    assert made.returncode == 0, made.stderr
    leaked = json.loads(made.stdout)["token"]
    release = shared_tmp / "release"
    job = Client(stack.url, leaked).submit(entrypoint="e2ejobs:held",
                                           params={"release": str(release)},
                                           resources={"gpus": 0})
    wait_for(lambda: job.status()["state"] == "running", timeout_s=WAIT_S,
             what="the job to run")

    try:
        # When the runbook's embedded-stack steps run as written, with the leaked token as
        # the client's
        script = "\n".join(b.text for b in doc(PAGE).run_blocks("rotate"))
        env = dict(stack.env, E31_URL=stack.url, E31_TOKEN=leaked, OLD_TOKEN=leaked)
        ran = run_command(script, env=env, cwd=tmp_path)

        # Then every step worked, the leaked token is refused and the new one served
        assert ran.returncode == 0, ran.output
        new = json.loads(profile.read_text())["token"]
        assert new not in (leaked, stack.token)
        try:
            Client(stack.url, leaked).list()
            raise AssertionError("the leaked token is still served")
        except ClientError as exc:
            assert exc.status_code == 401
        names = [t["name"] for t in Tenancy(Client(stack.url, new)).list_tokens()]
        assert "laptop" not in names and "ci-2027q1" in names

        # And the job submitted with the leaked token ran on and ends, read with the new one
        assert Client(stack.url, new).get(job.id).status()["state"] == "running"
        release.touch()
        wait_for(lambda: Client(stack.url, new).get(job.id).status()["state"] == "succeeded",
                 timeout_s=WAIT_S, what="the job to succeed")
    finally:
        release.touch()
        profile.write_text(before)    # the session's other tests use the stack's own token

