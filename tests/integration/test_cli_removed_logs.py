"""`e31 logs` of a job whose logs `e31 gc` removed (issue 32, rough edge 8): it printed nothing
and exited 0, as if the job had printed nothing; it now says they were removed, and when. The
CLI in a process of its own against the real API served on a local port over the test's store
and its artifact store; the retention policy (`e31 gc`'s) removes the job's artifacts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from fastapi.testclient import TestClient

from e31.core.clock import utcnow
from e31.edge.artifacts import ArtifactStore
from e31.ops.retention import collect
from e31.store import Repo
from tests.integration.test_api_limits import serving
from tests.integration.test_gc import DAY, ended_job


def test_the_logs_of_a_job_gc_removed_say_they_were_removed_and_when(
        repo: Repo, api: TestClient, tmp_path: Path) -> None:
    # Given a job that ended 40 days ago, and `e31 gc --older-than 30 --delete` run since
    store = ArtifactStore(f"file://{tmp_path / 'artifacts'}")   # the API's (make_app)
    tenant, token = repo.create_tenant("team-a", now=utcnow())
    job_id = ended_job(repo, store, tenant.id, ended=utcnow() - 40 * DAY, tmp_path=tmp_path,
                       name="old")
    collect(repo, store, older_than_days=30, now=utcnow(), delete=True)
    removed_at = repo.get_job(tenant.id, job_id).artifacts_removed_at
    assert removed_at is not None

    # When its logs are asked for
    env = {k: v for k, v in os.environ.items() if not k.startswith("E31_")}
    with serving(api.app) as port:       # type: ignore[arg-type]
        env.update(E31_URL=f"http://127.0.0.1:{port}", E31_TOKEN=token, E31_HOME=str(tmp_path))
        done = subprocess.run([sys.executable, "-m", "e31.cli", "logs", job_id], env=env,
                              capture_output=True, text=True, timeout=60, check=False)
        status = subprocess.run([sys.executable, "-m", "e31.cli", "status", job_id, "--json"],
                                env=env, capture_output=True, text=True, timeout=60,
                                check=False)

    # Then stdout is empty and stderr says they were removed by e31 gc, and when
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    assert f"the logs of {job_id} were removed by e31 gc at {removed_at.isoformat()}" \
        in done.stderr
    assert "logs and outputs are kept artifact_retention_days after the end" in done.stderr
    # And the status says it too
    assert f'"artifacts_removed_at": "{removed_at.isoformat()}"' in status.stdout
