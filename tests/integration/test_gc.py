"""`e31 gc`, the retention policy: a dry run lists what would go and removes nothing; a
deletion removes exactly the artifacts of the jobs that ended before the retention, and
their rows still answer. Real store (SQLite, and PostgreSQL with E31_TEST_DATABASE_URL) and
a real `file://` artifact store; the command itself runs as a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import MetaData, select, text

from e31.core.clock import utcnow
from e31.core.records import Outcome
from e31.core.sizeclasses import route
from e31.core.spec import JobSpec
from e31.core.states import AttemptReason
from e31.edge.artifacts import ArtifactStore
from e31.edge.logview import log_name
from e31.edge.settings import Settings
from e31.ops.retention import collect
from e31.store import Repo, make_engine
from e31.store.migrate import upgrade
from tests.integration.test_store import publish

DAY = timedelta(days=1)


def ended_job(repo: Repo, store: ArtifactStore, tenant_id: str, *, ended: datetime | None,
              tmp_path: Path, name: str) -> str:
    """A job that ran at `ended` (None: it still runs) and left an output of 1000 bytes, a
    log of 10 and a checkpoint of 100 in the store, its output charged to its tenant."""
    spec = JobSpec.parse({"resources": {"gpus": 0}, "command": ["true"], "name": name})
    job_id = repo.insert_job(tenant_id, spec, route(spec, Settings().size_classes),
                             now=(ended or utcnow()) - DAY).id
    at = ended or utcnow()
    claim = repo.claim(job_id, dispatch_token=publish(repo, job_id, at), worker="w", gpus="",
                       gpu_count=0, now=at, lease_ttl_s=60)
    assert claim is not None
    for rel, size in (("outputs/model.bin", 1000), (log_name(1), 10),
                      ("checkpoints/step.pt", 100)):
        local = tmp_path / "src" / job_id / rel
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_bytes(b"x" * size)
        store.put_file(local, tenant_id, job_id, rel)
    repo.charge_outputs(tenant_id, [1000], default_max_bytes=1 << 40)
    if ended is not None:
        repo.record_outcome(job_id, claim.token, Outcome(
            AttemptReason.SUCCEEDED, exit_code=0, outputs=[{"path": "model.bin", "size": 1000}]),
            now=ended)
    return job_id


def outputs_bytes(repo: Repo, tenant_id: str) -> int:
    return repo.charge_outputs(tenant_id, [], default_max_bytes=0).used_bytes


def test_a_dry_run_lists_the_old_jobs_and_a_deletion_removes_exactly_their_artifacts(
        repo: Repo, tmp_path: Path) -> None:
    # Given a job that ended 40 days ago, one that ended 10 days ago and one still running,
    # each with an output, a log and a checkpoint stored
    store = ArtifactStore(f"file://{tmp_path / 'artifacts'}")
    tenant, _ = repo.create_tenant("t", now=utcnow())
    now = utcnow()
    old = ended_job(repo, store, tenant.id, ended=now - 40 * DAY, tmp_path=tmp_path, name="old")
    recent = ended_job(repo, store, tenant.id, ended=now - 10 * DAY, tmp_path=tmp_path,
                       name="recent")
    running = ended_job(repo, store, tenant.id, ended=None, tmp_path=tmp_path, name="running")
    assert outputs_bytes(repo, tenant.id) == 3000

    # When the policy runs with a retention of 30 days as a dry run
    dry = collect(repo, store, older_than_days=30, now=now, delete=False)

    # Then it lists the old job alone, with its files and bytes, and removes nothing
    assert [j.job_id for j in dry.jobs] == [old]
    assert (dry.files, dry.bytes, dry.deleted) == (3, 1110, False)
    for job_id in (old, recent, running):
        assert store.footprint(tenant.id, job_id).bytes == 1110
    assert repo.get_job(None, old).outputs == [{"path": "model.bin", "size": 1000}]
    assert outputs_bytes(repo, tenant.id) == 3000

    # When it runs again and deletes
    done = collect(repo, store, older_than_days=30, now=now, delete=True)

    # Then exactly the old job's artifacts are gone, its row still answers with no outputs,
    # its bytes are given back to its tenant, and the other jobs keep everything
    assert [j.job_id for j in done.jobs] == [old] and (done.files, done.bytes) == (3, 1110)
    assert not (tmp_path / "artifacts" / tenant.id / old).exists()
    record = repo.get_job(tenant.id, old)
    assert (record.state, record.outputs) == ("succeeded", [])
    assert store.list_outputs(tenant.id, old) == [] and store.log_sizes(tenant.id, old) == {}
    for job_id in (recent, running):
        assert store.footprint(tenant.id, job_id).bytes == 1110
    assert outputs_bytes(repo, tenant.id) == 2000

    # And a later run finds nothing more to do; a retention of 0 days keeps everything
    assert collect(repo, store, older_than_days=30, now=now, delete=True).jobs == []
    forever = collect(repo, store, older_than_days=0, now=now + 1000 * DAY, delete=True)
    assert (forever.cutoff, forever.jobs) == (None, [])
    assert store.footprint(tenant.id, recent).bytes == 1110


def test_gc_removes_a_link_planted_in_an_old_jobs_directory_but_never_its_target(
        repo: Repo, tmp_path: Path) -> None:
    # Given an old job whose directory in the store holds a link to a file outside
    store = ArtifactStore(f"file://{tmp_path / 'artifacts'}")
    tenant, _ = repo.create_tenant("t", now=utcnow())
    now = utcnow()
    old = ended_job(repo, store, tenant.id, ended=now - 40 * DAY, tmp_path=tmp_path, name="old")
    outside = tmp_path / "outside" / "keep.txt"
    outside.parent.mkdir()
    outside.write_text("keep me")
    (tmp_path / "artifacts" / tenant.id / old / "outputs" / "link").symlink_to(outside.parent)

    # When gc deletes
    collect(repo, store, older_than_days=30, now=now, delete=True)

    # Then the job's directory is gone, and the link's target is untouched
    assert not (tmp_path / "artifacts" / tenant.id / old).exists()
    assert outside.read_text() == "keep me"


def e31(*args: str, home: Path, database_url: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, E31_HOME=str(home), E31_DATABASE_URL=database_url)
    return subprocess.run([sys.executable, "-m", "e31.cli", *args], env=env, capture_output=True,
                          text=True, timeout=60)


def test_e31_gc_is_a_dry_run_unless_told_to_delete(repo: Repo, database_url: str,
                                                   tmp_path: Path) -> None:
    # Given an old and a recent job in the store and artifacts of an E31_HOME
    home = tmp_path / "home"
    store = ArtifactStore(Settings(home=home).resolved_artifacts_url)
    tenant, _ = repo.create_tenant("t", now=utcnow())
    now = utcnow()
    old = ended_job(repo, store, tenant.id, ended=now - 40 * DAY, tmp_path=tmp_path, name="old")
    recent = ended_job(repo, store, tenant.id, ended=now - 10 * DAY, tmp_path=tmp_path,
                       name="recent")

    # When `e31 gc` runs with the default retention (30 days), without --delete
    dry = e31("gc", home=home, database_url=database_url)
    dry_json = e31("gc", "--json", home=home, database_url=database_url)

    # Then it says what it would remove and removes nothing
    assert dry.returncode == 0, dry.stderr
    assert "would remove the artifacts of 1 jobs" in dry.stdout and "1110 bytes" in dry.stdout
    assert "--delete" in dry.stdout
    report = json.loads(dry_json.stdout)
    assert (report["deleted"], report["job_count"], report["bytes"]) == (False, 1, 1110)
    assert [j["id"] for j in report["jobs"]] == [old]
    assert store.footprint(tenant.id, old).bytes == 1110

    # When it runs with --delete and a retention of 5 days
    done = e31("gc", "--older-than", "5", "--delete", "--json", home=home,
               database_url=database_url)

    # Then both jobs' artifacts are removed, and it says so
    assert done.returncode == 0, done.stderr
    removed = json.loads(done.stdout)
    assert removed["deleted"] and sorted(j["id"] for j in removed["jobs"]) == sorted([old, recent])
    assert removed["bytes"] == 2220
    assert store.footprint(tenant.id, old).files == store.footprint(tenant.id, recent).files == 0
    bad = e31("gc", "--older-than", "-1", home=home, database_url=database_url)
    assert bad.returncode == 2 and "must be a number of days" in bad.stderr


@pytest.mark.empty_store
def test_migration_0004_counts_the_outputs_stored_before_it_towards_each_tenant(
        database_url: str) -> None:
    # Given a store at revision 0003 whose jobs list outputs of two tenants
    engine = make_engine(database_url)
    upgrade(engine, "0003")
    tables = MetaData()
    tables.reflect(engine)
    tenants, jobs = tables.tables["tenants"], tables.tables["jobs"]
    now = utcnow()
    row = {"name": "n", "spec": {}, "size_class": "cpu", "queue": "e31.cpu", "gpus": 0,
           "priority": 0, "state": "succeeded", "submitted_at": now, "dispatch_count": 0,
           "attempts_used": 1, "lease_token": 1, "cancel_requested": False, "gpu_seconds": 0.0,
           "run_seconds": 0.0, "queued_seconds": 0.0}
    with engine.begin() as conn:
        conn.execute(tenants.insert(), [{"id": t, "name": t, "admin": False, "weight": 1.0,
                                         "created_at": now} for t in ("t-a", "t-b", "t-c")])
        conn.execute(jobs.insert(), [
            {**row, "id": "j-1", "tenant_id": "t-a", "outputs": [{"path": "x", "size": 5},
                                                                 {"path": "y", "size": 7}]},
            {**row, "id": "j-2", "tenant_id": "t-a", "outputs": [{"path": "z", "size": 30}]},
            {**row, "id": "j-3", "tenant_id": "t-b", "outputs": []},
            {**row, "id": "j-4", "tenant_id": "t-b", "outputs": [{"path": "w", "size": 100}]},
            {**row, "id": "j-5", "tenant_id": "t-c", "outputs": None}])

    # When the store is upgraded
    upgrade(engine)

    # Then each tenant's outputs total is the sum of its jobs' outputs
    with engine.connect() as conn:
        totals = dict(conn.execute(select(tenants.c.id, text("outputs_bytes"))).tuples().all())
    engine.dispose()
    assert totals == {"t-a": 42, "t-b": 100, "t-c": 0}
