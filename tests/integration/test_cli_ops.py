"""Operator commands against a real store: `e31 db upgrade`, `e31 tenant create`, and what a
tenant command loads (issue 32, rough edge 11: each took about 2 s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from alembic.script import ScriptDirectory
from sqlalchemy import inspect

from e31.edge import wiring
from e31.edge.settings import Settings
from e31.store import make_engine
from e31.store.migrate import MIGRATIONS_DIR, script_heads


def e31(*args: str, home: Path, database_url: str,
        python: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, E31_HOME=str(home), E31_DATABASE_URL=database_url)
    return subprocess.run([sys.executable, *python, "-m", "e31.cli", *args], env=env,
                          capture_output=True, text=True, timeout=60)


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


def imported(stderr: str) -> set[str]:
    """The top-level packages `python -X importtime` says a command imported."""
    return {line.rsplit("|", 1)[1].strip().split(".")[0] for line in stderr.splitlines()
            if line.startswith("import time:") and "|" in line}


def test_a_tenant_command_on_a_migrated_store_loads_no_alembic_redis_or_celery(
        database_url: str, tmp_path: Path) -> None:
    # Given a store a first tenant command migrated, with a tenant that has a limit
    created = e31("tenant", "create", "nlp", "--limit", "max_priority=7", home=tmp_path,
                  database_url=database_url)
    assert created.returncode == 0, created.stderr

    # When the tenants are listed, their imports timed
    listed = e31("tenant", "list", "--json", home=tmp_path, database_url=database_url,
                 python=("-X", "importtime"))

    # Then the list shows the limit, and none of Alembic (nothing to apply), Redis or Celery
    # (the store alone is used) was imported: about 0.8 s of the 2 s each command took
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout)["tenants"][0]["limits"] == {"max_priority": 7}
    loaded = imported(listed.stderr)
    assert "sqlalchemy" in loaded     # the timing is read: the store was imported
    assert not loaded & {"alembic", "redis", "celery", "kombu", "fsspec"}, loaded


def test_the_newest_revision_read_from_the_migrations_files_is_alembics() -> None:
    # The fast path of upgrade() compares the store with this set: it must be Alembic's heads
    assert script_heads() == set(ScriptDirectory(str(MIGRATIONS_DIR)).get_heads())
