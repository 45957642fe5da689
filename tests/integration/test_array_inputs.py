"""`array:<id>/outputs` inputs (a footage fan-out's merge job): only the array's own tenant
may name one at submit, and the worker stages an array's outputs only for its tenant."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis

from e31.api.services import Services
from e31.core.clock import utcnow
from e31.core.errors import SetupError, SpecConflict
from e31.core.spec import JobSpec
from e31.edge.artifacts import ArtifactStore
from e31.edge.settings import Settings
from e31.store import Repo
from e31_worker.attempt import inputs
from tests.integration.test_dependencies import array, end

pytest.importorskip("fsspec")


def staged(repo: Repo, artifacts: ArtifactStore, tenant_id: str, array_id: str,
           target: Path) -> Any:
    svc = SimpleNamespace(repo=repo, artifacts=artifacts)
    claim = SimpleNamespace(tenant_id=tenant_id, job_id="j-merge", attempt=1)
    return inputs._stage_array(svc, claim, array_id, target)  # type: ignore[arg-type]


def test_an_arrays_outputs_are_staged_for_its_tenant_and_refused_to_another(
        repo: Repo, tmp_path: Path) -> None:
    # Given tenant A's array whose one item left an output, and tenant B
    a, _ = repo.create_tenant("a", now=utcnow())
    b, _ = repo.create_tenant("b", now=utcnow())
    array_id, [item] = array(repo, a.id, 1)
    end(repo, item)
    artifacts = ArtifactStore(f"file://{tmp_path / 'artifacts'}")
    (tmp_path / "frames.jsonl").write_text("a's rows\n")
    artifacts.put_file(tmp_path / "frames.jsonl", a.id, item, "outputs/frames.jsonl")

    # When a merge job of B's asks for A's array, then it is refused and nothing is staged
    with pytest.raises(SetupError, match="no array"):
        staged(repo, artifacts, b.id, array_id, tmp_path / "b-chunks")
    assert not (tmp_path / "b-chunks").exists()

    # And the same request by A stages the item's output under its index
    staged(repo, artifacts, a.id, array_id, tmp_path / "a-chunks")
    assert (tmp_path / "a-chunks" / "000000" / "frames.jsonl").read_text() == "a's rows\n"


def test_a_spec_naming_another_tenants_array_is_refused_at_submit(
        repo: Repo, redis_client: redis.Redis, tmp_path: Path) -> None:
    # Given the API's service, and tenant A's array
    service = Services(settings=Settings(home=tmp_path), repo=repo, artifacts=ArtifactStore(
        f"file://{tmp_path / 'artifacts'}"), redis_client=redis_client).jobs
    a, _ = repo.create_tenant("a", now=utcnow())
    b, _ = repo.create_tenant("b", now=utcnow())
    array_id, _ = array(repo, a.id, 1)
    spec = JobSpec.parse({"entrypoint": "pkg.mod:main", "resources": {"gpus": 0},
                          "inputs": {"chunks": f"array:{array_id}/outputs"}})

    # When B submits it, then it is refused as a conflict naming the input; A's is stored
    with pytest.raises(SpecConflict) as refused:
        service.submit(b, spec)
    assert refused.value.errors[0]["field"] == "inputs.chunks"
    assert service.submit(a, spec).spec["inputs"] == {"chunks": f"array:{array_id}/outputs"}
