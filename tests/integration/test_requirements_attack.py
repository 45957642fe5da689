"""A hostile tenant's requirements cannot read the host (issue 25), with real uv, real
bubblewrap, a real store and real files.

The attack: a requirements file holding `-r <a file of the host>` made uv, run as root outside
any sandbox, quote that file back in its parse error, which became the job's error and log
(`/proc/<worker pid>/environ` held the Redis password). Two walls now stand in its way: the
check (`e31.core.requirements`: at submit, and again at the worker before uv runs) and the build's
sandbox (`e31_worker.attempt.buildbox`: the tenant's uid, bubblewrap's namespaces). Each wall
is shown holding alone, and the attack is shown succeeding with both taken down, so that no
test here passes because the attack never worked.
"""

from __future__ import annotations

import hashlib
import io
import os
import secrets
import shutil
import stat
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient

from e31.core.clock import utcnow
from e31.core.errors import SetupError, SpecError
from e31.core.sizeclasses import route
from e31.core.spec import JobSpec
from e31.core.states import AttemptReason
from e31.edge.artifacts import ArtifactStore
from e31.edge.bundlestore import BundleStore
from e31.edge.settings import Settings
from e31.store import Repo
from e31_worker.attempt import task
from e31_worker.attempt.buildbox import BuildSandbox
from e31_worker.attempt.envcache import EnvCache
from e31_worker.attempt.environment import BaseEnv, EnvRequest, UvBuild, uv_binary
from e31_worker.attempt.sandbox import Sandbox
from tests.conftest import wait_for
from tests.integration.conftest import MakeApp, bearer
from tests.integration.test_store import publish
from tests.integration.test_task import services

BUILD_TIMEOUT_S = 120.0
TENANT = "t-hostile"

needs_sandbox = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("bwrap") is None,
    reason="a sandboxed build needs root (to become the tenant's uid) and bubblewrap")


def tar_of(**files: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


# -- at submit: the API reads the file out of the bundle and refuses it -----------------------

@pytest.fixture
def api(make_app: MakeApp, repo: Repo) -> tuple[TestClient, dict[str, str]]:
    _, token = repo.create_tenant("hostile", now=utcnow())
    return TestClient(make_app()), bearer(token)


def upload(http: TestClient, headers: dict[str, str], data: bytes) -> str:
    digest = f"sha256:{hashlib.sha256(data).hexdigest()}"
    assert http.put(f"/v1/bundles/{digest}", content=data, headers=headers).status_code == 201
    return digest


def test_a_requirements_file_including_a_host_file_is_refused_at_submit_naming_the_line(
        api: tuple[TestClient, dict[str, str]]) -> None:
    http, headers = api
    # Given a bundle whose requirements file includes host files among plain requirements
    code = upload(http, headers, tar_of(**{
        "train.py": "print('hi')\n",
        "requirements.txt": "# deps\ntomli-w==1.2.0\n-r /etc/shadow\n"
                            "pkg @ file:///proc/1/environ\n"}))
    spec = {"command": ["python", "train.py"], "code": code,
            "python": {"requirements": "requirements.txt"}}

    # When it is submitted, as a job, a dry run and an array item
    job = http.post("/v1/jobs", json=spec, headers=headers)
    dry = http.post("/v1/jobs?dry_run=true", json=spec, headers=headers)
    array = http.post("/v1/arrays", json={"items": [spec, spec]}, headers=headers)

    # Then each is refused with 422 naming python.requirements and every bad line
    assert (job.status_code, dry.status_code, array.status_code) == (422, 422, 422)
    errors = job.json()["errors"]
    assert [e["field"] for e in errors] == ["python.requirements"] * 2
    assert errors[0]["reason"].startswith("requirements.txt, line 3: '-r /etc/shadow' is an "
                                          "option")
    assert errors[1]["reason"].startswith("requirements.txt, line 4: 'pkg @ file:///proc/1/"
                                          "environ' is a file: URL")
    assert dry.json()["errors"] == errors
    assert {e["field"] for e in array.json()["errors"]} == {
        "items[0].python.requirements", "items[1].python.requirements"}
    # and nothing was stored
    assert http.get("/v1/jobs", headers=headers).json()["jobs"] == []


def test_a_requirements_file_the_code_lacks_is_refused_at_submit(
        api: tuple[TestClient, dict[str, str]]) -> None:
    http, headers = api
    code = upload(http, headers, tar_of(**{"train.py": "print('hi')\n"}))
    answer = http.post("/v1/jobs", json={"command": ["true"], "code": code,
                                         "python": {"requirements": "reqs/requirements.txt"}},
                       headers=headers)
    assert answer.status_code == 422
    [error] = answer.json()["errors"]
    assert error["field"] == "python.requirements" and "not a file of the job's code" in \
        error["reason"]


def test_plain_requirements_in_the_bundle_are_taken_at_submit(
        api: tuple[TestClient, dict[str, str]]) -> None:
    http, headers = api
    code = upload(http, headers, tar_of(**{
        "sub/requirements.txt": "# pinned\ntomli-w==1.2.0  # small\n\npkg[x]>=1; "
                                "python_version >= '3.9'\n"}))
    answer = http.post("/v1/jobs", json={"command": ["true"], "code": code,
                                         "python": {"requirements": "sub/requirements.txt"}},
                       headers=headers)
    assert answer.status_code == 201, answer.text


def test_a_pip_item_that_is_no_plain_requirement_is_refused_at_submit_naming_its_index(
        api: tuple[TestClient, dict[str, str]]) -> None:
    http, headers = api
    answer = http.post("/v1/jobs", json={"command": ["true"], "python": {
        "pip": ["tomli-w", "-r /etc/shadow"]}}, headers=headers)
    assert answer.status_code == 422
    [error] = answer.json()["errors"]
    assert error["field"] == "python.pip[1]" and "is an option" in error["reason"]


# -- at build: the check, the sandbox, and the attack with both off ---------------------------

@pytest.fixture
def host_secrets(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """Two things of the host no tenant may read: a root-only canary file (mode 0600, random
    content) in a directory every sandboxed job sees (`sandbox_read_only_dirs`), and the
    environment of a running process that holds a secret, as the worker's own does."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    canary = shared / "secrets.key"
    canary_text = f"master-key: {secrets.token_hex(16)}"   # no requirement: uv quotes it
    canary.write_text(canary_text + "\n")
    canary.chmod(0o600)
    secret = secrets.token_hex(16)
    holder = subprocess.Popen(["sleep", "300"], env={"E31_REDIS_PASSWORD": secret,
                                                     "PATH": os.environ["PATH"]})
    environ = Path(f"/proc/{holder.pid}/environ")
    wait_for(lambda: secret.encode() in environ.read_bytes(), timeout_s=10,
             what="the holder to exec with its secret")
    try:
        yield {"shared": shared, "files": {"canary": (canary, canary_text.split()[-1]),
                                           "environ": (environ, secret)}}
    finally:
        holder.kill()
        holder.wait()


def attack(tmp_path: Path, host_secrets: dict[str, Any], target: str, *, sandboxed: bool,
           check: bool) -> tuple[str, str]:
    """Build an environment whose requirements file includes `target` (`-r`), with or without
    the sandbox and the check; what the build said (its error, and the attempt's log) and the
    secret the target holds."""
    path, secret = host_secrets["files"][target]
    settings = Settings(home=tmp_path / "home",
                        sandbox_read_only_dirs=(str(host_secrets["shared"]),))
    sandbox = BuildSandbox.for_tenant(Sandbox.from_settings(settings), TENANT) if sandboxed \
        else None
    request = EnvRequest(pip=(), requirements=f"tomli-w==1.2.0\n-r {path}\n",
                         requirements_name="requirements.txt")
    scratch = settings.resolved_work_dir / ".envs" / ".build-attack"
    scratch.mkdir(parents=True)
    log = tmp_path / "attempt.log"
    build = UvBuild(request, BaseEnv.current(), uv=uv_binary(), log_path=log,
                    beat=lambda: None, beat_s=1.0, timeout_s=BUILD_TIMEOUT_S, sandbox=sandbox,
                    check=check)
    with pytest.raises(SetupError) as failed:
        build(scratch)
    said = str(failed.value) + "\n" + (log.read_text() if log.exists() else "")
    return said, secret


@pytest.mark.parametrize("target", ["canary", "environ"])
def test_with_both_walls_down_the_build_quotes_a_host_secret_back(
        tmp_path: Path, host_secrets: dict[str, Any], target: str) -> None:
    # Given a build as root, unsandboxed and unchecked (as before issue 25)
    # When its requirements include a root-only file or a process's environment
    said, secret = attack(tmp_path, host_secrets, target, sandboxed=False, check=False)

    # Then uv read it and quoted it back: the attack is real
    assert secret in said


@needs_sandbox
@pytest.mark.parametrize("target", ["canary", "environ"])
def test_the_sandbox_alone_keeps_a_host_secret_from_the_build(
        tmp_path: Path, host_secrets: dict[str, Any], target: str) -> None:
    # Given a build in the tenant's sandbox, with the check off
    # When its requirements include a root-only file or a process's environment
    said, secret = attack(tmp_path, host_secrets, target, sandboxed=True, check=False)

    # Then uv ran and failed to read it (the canary: denied to the tenant's uid; the
    # process: not in the build's PID namespace), and nothing of the secret came back
    assert "e31: $ uv pip compile" in said
    assert secret not in said
    assert ("Permission denied" if target == "canary" else "No such file") in said


@pytest.mark.parametrize("sandboxed", [False, pytest.param(True, marks=needs_sandbox)])
@pytest.mark.parametrize("target", ["canary", "environ"])
def test_the_check_refuses_the_build_before_uv_runs_naming_the_line(
        tmp_path: Path, host_secrets: dict[str, Any], target: str, sandboxed: bool) -> None:
    # Given a build with the check on (sandboxed or not)
    # When its requirements include a host file
    said, secret = attack(tmp_path, host_secrets, target, sandboxed=sandboxed, check=True)

    # Then it is refused naming the field and the line, and uv never ran
    path, _ = host_secrets["files"][target]
    assert said.startswith(f"python.requirements: requirements.txt, line 2: '-r {path}' is an "
                           "option")
    assert "$ uv" not in said and secret not in said


@needs_sandbox
def test_an_environment_built_in_the_sandbox_is_published_root_owned_and_read_only(
        tmp_path: Path) -> None:
    # Given the worker's sandbox and a tenant's build through the host's cache (offline:
    # it asks for nothing the worker lacks)
    settings = Settings(home=tmp_path / "home")
    sandbox = BuildSandbox.for_tenant(Sandbox.from_settings(settings), TENANT)
    cache = EnvCache(settings.resolved_work_dir / ".envs", max_bytes=1 << 40, beat_s=1.0)
    build = UvBuild(EnvRequest(pip=()), BaseEnv.current(), uv=uv_binary(),
                    log_path=tmp_path / "attempt.log", beat=lambda: None, beat_s=1.0,
                    timeout_s=BUILD_TIMEOUT_S, sandbox=sandbox)

    # When it is built
    env = cache.acquire("k-sandboxed", build, beat=lambda: None)
    env.release()

    # Then uv ran as the tenant (its log says so by the files it made) and what the cache
    # publishes is root's, with no write bit for anyone else and no set-id bit
    assert "e31: $ uv venv" in (tmp_path / "attempt.log").read_text()
    for top, dirs, files in os.walk(env.path):
        for name in [".", *dirs, *files]:
            st = os.lstat(os.path.join(top, name))
            assert (st.st_uid, st.st_gid) == (0, 0), os.path.join(top, name)
            if not stat.S_ISLNK(st.st_mode):
                assert not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH | stat.S_ISUID
                                         | stat.S_ISGID), os.path.join(top, name)
    # and the tenant's uid cannot write into it
    uid = sandbox.uid

    def become_tenant() -> None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)

    tried = subprocess.run(["touch", str(env.path / "bin" / "planted")],
                           preexec_fn=become_tenant, capture_output=True, text=True, timeout=30)
    assert tried.returncode != 0 and "Permission denied" in tried.stderr


# -- at the worker: a spec stored before the check --------------------------------------------

def test_a_spec_stored_before_the_check_fails_its_attempt_with_reason_setup(
        repo: Repo, redis_client: redis.Redis, tmp_path: Path) -> None:
    # Given a job stored without the API's check, whose code's requirements include a host file
    artifacts = ArtifactStore(f"file://{tmp_path / 'artifacts'}")
    tenant, _ = repo.create_tenant("old-spec", now=utcnow())
    store = BundleStore(artifacts.url)
    with store.upload(tenant.id) as up:
        up.write(tar_of(**{"requirements.txt": "tomli-w\n-r /etc/shadow\n"}))
        code = store.commit(up, tenant.id)
    spec = JobSpec.parse({"command": ["python", "-c", "print('the job ran')"], "code": code,
                          "python": {"requirements": "requirements.txt"},
                          "resources": {"gpus": 0}, "retries": {"max": 3}})
    job = repo.insert_job(tenant.id, spec, route(spec, Settings().size_classes), now=utcnow())

    # When a worker runs it
    task.run_job(services(repo, redis_client, tmp_path, artifacts), job.id,
                 publish(repo, job.id))

    # Then its one attempt failed with reason setup (no retry), naming the field and the line,
    # and neither uv nor the job ran
    record = repo.get_job(None, job.id)
    assert record.state == "failed"
    assert [a.reason for a in record.attempts] == [AttemptReason.SETUP]
    assert record.error == ("setup failed: python.requirements: requirements.txt, line 2: "
                            "'-r /etc/shadow' is an option (-r, -c, -e, --index-url, "
                            "--find-links, …); a job's requirements name packages only (name, "
                            "extras, version, marker); the package index is the pool's")
    log_view = artifacts.log_view(tenant.id, job.id, 1)
    log = b"".join(log_view.read(0, log_view.size_bytes)).decode()
    assert "line 2" in log and "$ uv" not in log and "the job ran" not in log


def test_a_pip_item_stored_before_the_check_fails_its_attempt_with_reason_setup(
        repo: Repo, redis_client: redis.Redis, tmp_path: Path) -> None:
    # Given a job stored without the API's check, asking for a URL requirement naming a host file
    artifacts = ArtifactStore(f"file://{tmp_path / 'artifacts'}")
    tenant, _ = repo.create_tenant("old-pip", now=utcnow())
    data = {"command": ["python", "-c", "print('the job ran')"], "resources": {"gpus": 0},
            "python": {"pip": ["tomli-w", "pkg @ file:///etc/shadow"]}, "retries": {"max": 3}}
    with pytest.raises(SpecError, match=r"python.pip\[1\]"):
        JobSpec.parse(data)                     # what the API answers today
    spec = JobSpec.parse(data, stored=True)     # what a store of before still holds
    job = repo.insert_job(tenant.id, spec, route(spec, Settings().size_classes), now=utcnow())

    # When a worker claims and runs it (the claim reads the stored spec back)
    task.run_job(services(repo, redis_client, tmp_path, artifacts), job.id,
                 publish(repo, job.id))

    # Then its one attempt failed with reason setup, naming the item, and the job never ran
    record = repo.get_job(None, job.id)
    assert record.state == "failed"
    assert [a.reason for a in record.attempts] == [AttemptReason.SETUP]
    assert "python.pip[1]" in (record.error or "") and "file:" in (record.error or "")
