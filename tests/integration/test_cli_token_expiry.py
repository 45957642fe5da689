"""`e31 token create --expires-at` keeps the very instant given (issue 32, rough edge 6): the CLI
turned it into seconds and the API added them to its own now, so `2027-01-31T00:00:00Z` was
stored as `…00:00:00.109670+00:00`. The CLI in a process of its own against the real API served
on a local port over the test's store; and the API's refusals of an `expires_at`, each named.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

from fastapi.testclient import TestClient

from e31.core.clock import utcnow
from e31.store import Repo
from tests.integration.conftest import bearer
from tests.integration.test_api_limits import serving


def midnight_in(days: int) -> str:
    """Midnight UTC `days` from today, as a user writes it (`…T00:00:00Z`)."""
    return f"{(utcnow() + timedelta(days=days)).date().isoformat()}T00:00:00Z"


def test_token_create_expires_at_is_stored_and_listed_exactly_as_given(
        repo: Repo, api: TestClient, tmp_path: Path) -> None:
    # Given a tenant, and an instant at midnight (2027-01-31T00:00:00Z in the issue)
    _, token = repo.create_tenant("team-a", now=utcnow())
    at = midnight_in(60)

    # When the CLI makes a token that expires then, and lists the tokens
    env = {k: v for k, v in os.environ.items() if not k.startswith("E31_")}
    with serving(api.app) as port:       # type: ignore[arg-type]
        env.update(E31_URL=f"http://127.0.0.1:{port}", E31_TOKEN=token, E31_HOME=str(tmp_path))

        def e31(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "e31.cli", *args], env=env,
                                  capture_output=True, text=True, timeout=60, check=False)
        made = e31("token", "create", "nightly", "--expires-at", at, "--json")
        listed = e31("token", "list", "--json")
        naive = e31("token", "create", "naive", "--expires-at", at.removesuffix("Z"))

    # Then the answer and the list hold exactly that instant, to the microsecond
    assert made.returncode == 0, made.stderr
    exact = at.replace("Z", "+00:00")
    assert json.loads(made.stdout)["expires_at"] == exact
    assert listed.returncode == 0, listed.stderr
    tokens = {t["name"]: t for t in json.loads(listed.stdout)["tokens"]}
    assert tokens["nightly"]["expires_at"] == exact
    # and one without a zone is the user's to fix: exit 2 naming expires_at, no token made
    assert naive.returncode == 2 and "expires_at" in naive.stderr, naive.stderr
    assert "naive" not in tokens


def test_an_expires_at_past_too_far_or_not_rfc3339_is_refused_by_name(
        repo: Repo, api: TestClient) -> None:
    # Given a tenant
    _, token = repo.create_tenant("team-a", now=utcnow())

    def create(name: str, **expiry: object) -> tuple[int, str | None]:
        answer = api.post("/v1/tokens", json={"name": name, **expiry}, headers=bearer(token))
        field = answer.json()["errors"][0]["field"] if answer.status_code == 422 else None
        return answer.status_code, field

    # When it asks for tokens expiring at instants it may not have
    refused = {
        "no zone": create("a", expires_at=midnight_in(60).removesuffix("Z")),
        "past": create("b", expires_at="2020-01-01T00:00:00Z"),
        "beyond ten years": create("c", expires_at=midnight_in(3651 + 1)),
        "both": create("d", expires_at=midnight_in(60), expires_in_s=3600),
        "no time": create("e", expires_at="next tuesday"),
        # RFC 3339, as the document's format says: seconds too (fromisoformat alone reads these)
        "no seconds": create("e", expires_at=midnight_in(60).replace(":00Z", "Z")),
        "a date alone": create("e", expires_at=midnight_in(60)[:10]),
    }

    # Then each is refused naming expires_at, and none was made
    assert refused == {why: (422, "expires_at") for why in refused}
    names = {t["name"] for t in api.get("/v1/tokens", headers=bearer(token)).json()["tokens"]}
    assert names == {"default"}
    # while the same instants, within bounds and alone, are served
    assert create("f", expires_at=midnight_in(60)) == (201, None)
    assert create("g", expires_at=midnight_in(3640)) == (201, None)
    assert create("h", expires_in_s=3600) == (201, None)
    # and so is RFC 3339 in lower case, with a fraction and an offset
    assert create("i", expires_at=midnight_in(60).lower().replace("z", ".25+02:00")) == (201, None)
