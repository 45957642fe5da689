"""Operator commands against a real store: `e31 db upgrade`, `e31 tenant create`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from sqlalchemy import inspect

from e31.edge import wiring
from e31.edge.settings import Settings
from e31.store import make_engine


def e31(*args: str, home: Path, database_url: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, E31_HOME=str(home), E31_DATABASE_URL=database_url)
    return subprocess.run([sys.executable, "-m", "e31.cli", *args], env=env, capture_output=True,
                          text=True, timeout=60)


def test_db_upgrade_creates_the_schema_and_can_run_again(database_url: str, tmp_path: Path) -> None:
    for _ in range(2):
        done = e31("db", "upgrade", home=tmp_path, database_url=database_url)
        assert done.returncode == 0, done.stderr
    tables = set(inspect(make_engine(database_url)).get_table_names())
    assert {"tenants", "api_keys", "jobs", "attempts", "alembic_version"} <= tables


def test_tenant_create_prints_the_token_once_and_refuses_a_taken_name(database_url: str,
                                                                       tmp_path: Path) -> None:
    created = e31("tenant", "create", "vision-team", "--json", home=tmp_path,
                  database_url=database_url)
    assert created.returncode == 0, created.stderr
    printed = json.loads(created.stdout)
    assert printed["tenant"] == "vision-team" and printed["token"].startswith("e31_")
    repo = wiring.repo(Settings.load({"home": tmp_path, "database_url": database_url}))
    assert repo.tenant_for_token(printed["token"]).name == "vision-team"

    again = e31("tenant", "create", "vision-team", home=tmp_path, database_url=database_url)
    assert again.returncode == 2
    assert "exists already" in again.stderr


def test_tenant_create_and_update_set_the_weight_and_quotas(database_url: str,
                                                            tmp_path: Path) -> None:
    # Given a tenant created with a weight and a quota
    created = e31("tenant", "create", "nlp", "--weight", "2", "--quota", "gpu80=8", "--json",
                  home=tmp_path, database_url=database_url)
    assert created.returncode == 0, created.stderr
    assert json.loads(created.stdout)["quotas"] == {"gpu80": 8}

    # When the operator changes the weight, adds a quota and drops the first
    updated = e31("tenant", "update", "nlp", "--weight", "3", "--quota", "gpu24=2",
                  "--no-quota", "gpu80", "--json", home=tmp_path, database_url=database_url)

    # Then the store holds exactly that, and a bad quota or class is refused
    assert updated.returncode == 0, updated.stderr
    assert json.loads(updated.stdout) == {"tenant": "nlp", "admin": False, "weight": 3.0,
                                          "quotas": {"gpu24": 2}, "disabled": False,
                                          "disabled_at": None, "limits": {}}
    bad = e31("tenant", "update", "nlp", "--quota", "gpu99=1", home=tmp_path,
              database_url=database_url)
    assert bad.returncode == 2 and "unknown size class" in bad.stderr
    missing = e31("tenant", "update", "nobody", "--weight", "1", home=tmp_path,
                  database_url=database_url)
    assert missing.returncode == 2 and "no tenant named" in missing.stderr
