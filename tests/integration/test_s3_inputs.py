"""A job's `s3://` inputs against the artifact store on a real S3 server (moto in server mode,
tests/integration/conftest.py): tenant A's outputs in the store's bucket cannot be named as
tenant B's input, neither at submit (403 naming the input) nor by the worker (the API check
bypassed), nor with the path check off, since inputs are read anonymously (or with credentials
of their own), never with the store's (e31.edge.s3inputs); while the worker as it was, reading with
the store's credentials, gets it, so the test cannot pass on an unreadable object."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import redis
from fastapi.testclient import TestClient

from e31.api import create_app
from e31.api.services import Services
from e31.core.clock import utcnow
from e31.core.errors import SetupError
from e31.core.records import Claim
from e31.core.spec import JobSpec
from e31.edge.artifacts import ArtifactStore
from e31.edge.s3inputs import artifact_store_input, input_storage_options
from e31.edge.settings import Settings
from e31.store import Repo
from e31_worker.attempt import inputs as inputs_module
from e31_worker.attempt.inputs import stage_inputs
from e31_worker.attempt.plan import AttemptPlan
from e31_worker.attempt.services import AttemptServices
from tests.integration.conftest import ACCESS_KEY, SECRET_KEY, S3Server

OUTPUT = b"tenant A's private result"


@pytest.fixture
def stolen(s3: S3Server, s3_url: str, tmp_path: Path) -> str:
    """The URL of tenant A's job output, as the artifact store wrote it to the bucket."""
    out = tmp_path / "a-out"
    out.mkdir()
    (out / "result.txt").write_bytes(OUTPUT)
    ArtifactStore(s3_url, storage_options=s3.options).put_tree(out, "t-a", "j-a", "outputs")
    return f"{s3_url}/t-a/j-a/outputs/result.txt"


def _settings(s3: S3Server, artifacts_url: str, tmp_path: Path, **more: Any) -> Settings:
    return Settings(home=tmp_path / "home", artifacts_url=artifacts_url,
                    s3_endpoint_url=s3.endpoint, s3_access_key_id=ACCESS_KEY,
                    s3_secret_access_key=SECRET_KEY, inputs_s3_endpoint_url=s3.endpoint,
                    redis_url="redis://unused", **more)


def _forms(url: str) -> list[str]:
    """The URL as written, and ways of writing the same object a check might miss."""
    bucket, key = url[len("s3://"):].split("/", 1)
    return [url, f"S3://{bucket.upper()}/{key}", f"s3://{bucket}//{key}",
            f"s3://{bucket}/x/../{key}", f"s3://{bucket}/{key.split('/')[0]}/t-a/"]


def _submit(s3: S3Server, artifacts_url: str, tmp_path: Path, repo: Repo,
            redis_client: redis.Redis, source: str) -> Any:
    settings = _settings(s3, artifacts_url, tmp_path)
    service = Services(settings=settings, repo=repo,
                      artifacts=ArtifactStore(artifacts_url, storage_options=s3.options),
                      redis_client=redis_client)
    _, token = repo.create_tenant(f"b-{len(repo.list_tenants())}", now=utcnow())
    client = TestClient(create_app(settings, services=service))
    return client.post("/v1/jobs", json={"entrypoint": "m:f", "inputs": {"theirs": source}},
                       headers={"Authorization": f"Bearer {token}"})


def test_another_tenants_output_in_the_store_is_refused_at_submit(
        s3: S3Server, s3_url: str, stolen: str, tmp_path: Path, sqlite_repo: Repo,
        redis_client: redis.Redis) -> None:
    # When tenant B names tenant A's output in the artifact bucket as an input, in any form
    for form in _forms(stolen):
        answer = _submit(s3, s3_url, tmp_path, sqlite_repo, redis_client, form)
        # Then the API refuses it, naming the input and why
        assert answer.status_code == 403, (form, answer.text)
        assert "inputs.theirs" in answer.text and "artifact store" in answer.text, answer.text

    # And the same spec is accepted where the store lies elsewhere (the check is what refused)
    answer = _submit(s3, f"{s3_url}-elsewhere", tmp_path, sqlite_repo, redis_client, stolen)
    assert answer.status_code in (200, 201, 202), answer.text


def _stage(settings: Settings, source: str, root: Path) -> Path:
    """Stage one input as the worker's prepare stage does, for tenant B's job."""
    spec = JobSpec.parse({"entrypoint": "m:f", "inputs": {"theirs": source}})
    plan = AttemptPlan(job_id="j-b", attempt=1, spec=spec, gpus="", root=root,
                       kill_grace_s=1.0, log_max_bytes=1 << 20, tick_interval_s=1.0)
    claim = Claim(job_id="j-b", tenant_id="t-b", token=1, attempt=1, spec=spec, gpus=0)
    stage_inputs(cast(AttemptServices, SimpleNamespace(settings=settings)), claim, plan)
    return plan.input_dir / "theirs"


def test_the_worker_refuses_the_stores_objects_when_the_api_check_is_bypassed(
        s3: S3Server, s3_url: str, stolen: str, tmp_path: Path) -> None:
    # Given a queued spec naming tenant A's output (the API's check bypassed)
    settings = _settings(s3, s3_url, tmp_path)
    for n, form in enumerate(_forms(stolen)):
        # Then the worker refuses to stage it, naming the input, and stages nothing
        with pytest.raises(SetupError, match=r"inputs\.theirs: refused .*artifact store"):
            _stage(settings, form, tmp_path / f"a{n}")
        assert not (tmp_path / f"a{n}" / "inputs" / "theirs").exists()

    # And with the path check off (the store configured elsewhere), the inputs' own access
    # (anonymous) still cannot read it: the credentials are not the store's
    elsewhere = _settings(s3, f"{s3_url}-elsewhere", tmp_path)
    with pytest.raises(SetupError, match="Forbidden"):
        _stage(elsewhere, stolen, tmp_path / "anon")
    # while the worker as it was (fsspec with the store's credentials, which botocore's
    # default chain finds on a worker whose store uses it) reads it: the attack is real
    fallback = tmp_path / "as-it-was"
    inputs_module._copy_remote(stolen, fallback, s3.options)
    assert fallback.read_bytes() == OUTPUT


def test_a_public_object_is_read_anonymously(s3: S3Server, s3_url: str, tmp_path: Path) -> None:
    client = s3.client()
    client.create_bucket(Bucket="e31-public-data")
    client.put_object(Bucket="e31-public-data", Key="d/x.csv", Body=b"a,b\n", ACL="public-read")
    staged = _stage(_settings(s3, s3_url, tmp_path), "s3://e31-public-data/d/x.csv",
                    tmp_path / "pub")
    assert staged.read_bytes() == b"a,b\n"


def test_inputs_are_read_without_the_stores_credentials(s3: S3Server, s3_url: str,
                                                        tmp_path: Path) -> None:
    # The store's options carry its key; the inputs' never do: anonymous by default
    settings = _settings(s3, s3_url, tmp_path)
    assert input_storage_options(settings) == {"endpoint_url": s3.endpoint, "anon": True}
    own = _settings(s3, s3_url, tmp_path, inputs_s3_access_key_id="inputs-key",
                    inputs_s3_secret_access_key="inputs-secret")
    assert input_storage_options(own) == {"endpoint_url": s3.endpoint, "key": "inputs-key",
                                          "secret": "inputs-secret"}
    # Settings that would read inputs with the store's credentials fail the input, naming why
    for same in (
            _settings(s3, s3_url, tmp_path, inputs_s3_access_key_id=ACCESS_KEY,
                      inputs_s3_secret_access_key=SECRET_KEY),
            Settings(home=tmp_path, artifacts_url=s3_url, redis_url="redis://unused",
                     inputs_s3_anonymous=False)):
        with pytest.raises(SetupError, match="artifact store"):
            _stage(same, "s3://some-public-bucket/data.csv", tmp_path / "same")


def test_only_the_stores_own_prefix_is_refused() -> None:
    store = "s3://shared-bucket/e31"
    assert artifact_store_input("s3://shared-bucket/e31/t/j/outputs/x", store)
    assert artifact_store_input("s3://shared-bucket/e31", store)
    assert artifact_store_input("s3://other/x::s3://shared-bucket/e31/t", store)   # chained
    assert artifact_store_input("s3://shared-bucket/datasets/x.csv", store) is None
    assert artifact_store_input("s3://shared-bucket/e31-public/x.csv", store) is None
    assert artifact_store_input("s3://other-bucket/e31/x", store) is None
    assert artifact_store_input("s3://shared-bucket/anything", "s3://shared-bucket")
    assert artifact_store_input("s3://shared-bucket/e31/x", "file:///srv/e31") is None
