"""Quotas on what jobs leave behind: the log of a job across its attempts, GET …/logs in
bounded chunks, and outputs per job and per tenant.

Real store (SQLite, and PostgreSQL with E31_TEST_DATABASE_URL), real Redis, real worker
attempts (`task.run_job`, child processes) and the real API app over a `file://` store. Each
attack runs twice: `capped` (the limit at a small value: the attack fails) and `uncapped`
(the same limit set huge: the same test sees the attack succeed), which proves that the test
would catch the hole.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient

from e31.api import create_app
from e31.api.services import Services
from e31.client import Client
from e31.core.clock import utcnow
from e31.core.sizeclasses import route
from e31.core.spec import JobSpec
from e31.edge.artifacts import ArtifactStore
from e31.edge.logview import log_name
from e31.edge.settings import Settings
from e31.ops.heartbeat import WorkerInfo
from e31.store import Repo
from e31_worker.attempt import task
from e31_worker.attempt.groups import GroupRegistry
from e31_worker.attempt.services import AttemptServices
from tests.integration.test_store import publish

HUGE = 1 << 50      # a cap set this high is no cap at all: the attack then succeeds


@pytest.fixture(params=["capped", "uncapped"])
def capped(request: pytest.FixtureRequest) -> bool:
    return bool(request.param == "capped")


@pytest.fixture
def store(tmp_path: Path) -> ArtifactStore:
    return ArtifactStore(f"file://{tmp_path / 'artifacts'}")


def services(repo: Repo, r: redis.Redis, store: ArtifactStore, tmp_path: Path,
             **limits: Any) -> AttemptServices:
    """A cpu worker's services over the real store, without cgroups, with `limits` set."""
    settings = Settings(redis_url="redis://unused", work_dir=str(tmp_path / "work"),
                        heartbeat_interval_s=0.2, kill_grace_s=1, **limits)
    identity = WorkerInfo(node="cpu0@test", queues=("e31.cpu",), gpus="", gpu_count=0,
                          size_class="cpu")
    return AttemptServices(settings=settings, identity=identity, repo=repo, artifacts=store,
                           redis=r, groups=GroupRegistry(tmp_path / "work" / ".groups" / "cpu0"),
                           cgroups=None, draining=threading.Event(), busy=lambda _job: None)


def read_log(store: ArtifactStore, tenant_id: str, job_id: str, attempt: int) -> bytes:
    """One attempt's whole stored log (small in these tests)."""
    view = store.log_view(tenant_id, job_id, attempt)
    return b"".join(view.read(0, view.size_bytes))


def submit(repo: Repo, tenant_id: str, script: str, **fields: Any) -> str:
    spec = JobSpec.parse({"resources": {"gpus": 0}, "command": ["sh", "-c", script], **fields})
    return repo.insert_job(tenant_id, spec, route(spec, Settings().size_classes), now=utcnow()).id


def run_to_the_end(repo: Repo, svc: AttemptServices, job_id: str) -> str:
    """Deliver the job to the worker, as the scheduler would, until it ends; its final state."""
    for _ in range(10):
        task.run_job(svc, job_id, publish(repo, job_id))
        state = repo.get_job(None, job_id).state
        if state != "queued":
            return state
    raise AssertionError(f"job {job_id} did not end in 10 attempts")


# -- the log of a job across its attempts ---------------------------------------------------

def test_a_job_cannot_write_more_log_than_its_cap_across_its_attempts(
        capped: bool, repo: Repo, redis_client: redis.Redis, store: ArtifactStore,
        tmp_path: Path) -> None:
    # Given a job that writes 3000 bytes and fails, with two retries, under a per-attempt cap
    # of 4000 bytes and a per-job cap of 5000 (or none to speak of)
    tenant, _ = repo.create_tenant("t", now=utcnow())
    job_id = submit(repo, tenant.id, "head -c 3000 /dev/zero | tr '\\0' x; exit 1",
                    retries={"max": 2, "backoff_s": 0})
    svc = services(repo, redis_client, store, tmp_path, log_max_bytes=4000,
                   job_log_max_bytes=5000 if capped else HUGE)

    # When it runs its three attempts on a real worker
    assert run_to_the_end(repo, svc, job_id) == "failed"

    # Then its logs together stay within the job's cap (plus the lines that say where they
    # were cut), the second attempt's log says why it was cut and the third holds no output
    logs = {n: read_log(store, tenant.id, job_id, n) for n in (1, 2, 3)}
    if not capped:
        assert [len(log) for log in logs.values()] == [3000, 3000, 3000]  # the attack: 9000
        return
    assert logs[1] == b"x" * 3000
    assert logs[2].startswith(b"x" * 2000) and b"x" * 2001 not in logs[2]
    assert b"[e31: log cut at 2000 bytes: this job's logs reached job_log_max_bytes=5000" \
        in logs[2]
    assert logs[3].startswith(b"\n[e31: log cut at 0 bytes: this job's logs reached")
    assert sum(log.count(b"xx") for log in logs.values()) == 2500    # 5000 bytes of output


# -- GET …/logs in bounded chunks -----------------------------------------------------------

class Api:
    """The real API app over `store`, and a `Client` that talks to it."""

    def __init__(self, repo: Repo, store: ArtifactStore, redis_url: str, r: redis.Redis,
                 home: Path, token: str, **limits: Any) -> None:
        settings = Settings(redis_url=redis_url, home=home, **limits)
        service = Services(settings=settings, repo=repo, artifacts=store, redis_client=r)
        headers = {"Authorization": f"Bearer {token}"}
        self.http = TestClient(create_app(settings, services=service), headers=headers)
        self.client = Client("http://testserver", token)
        self.client._http = self.http  # every call of the client goes to the app in-process


def stored_logs(store: ArtifactStore, tenant_id: str, job_id: str, tmp_path: Path) -> list[bytes]:
    """Three attempts' logs of about 5000 bytes each, in UTF-8 with characters of 1 to 4
    bytes (so that a chunk's end falls inside a character), stored as a worker stores them."""
    texts = []
    for n in (1, 2, 3):
        text = (f"attempt {n}: " + "aé€😀" * 1000).encode()[:5000].decode(errors="ignore").encode()
        local = tmp_path / f"attempt-{n}.log"
        local.write_bytes(text)
        store.put_file(local, tenant_id, job_id, log_name(n))
        texts.append(text)
    return texts


def test_get_logs_answers_bounded_chunks_that_the_client_puts_back_together_exactly(
        capped: bool, repo: Repo, store: ArtifactStore, redis_url: str,
        redis_client: redis.Redis, tmp_path: Path) -> None:
    # Given a job with three attempts' logs of about 5000 bytes, and an API whose chunk is 1 KiB
    # (or unbounded)
    tenant, token = repo.create_tenant("t", now=utcnow())
    job_id = submit(repo, tenant.id, "true")
    texts = stored_logs(store, tenant.id, job_id, tmp_path)
    whole = b"".join(f"=== attempt {n} ===\n".encode() + t for n, t in zip((1, 2, 3), texts,
                                                                            strict=True))
    api = Api(repo, store, redis_url, redis_client, tmp_path / "home", token,
              log_chunk_max_bytes=1024 if capped else HUGE)

    # When a tenant asks for all of it in one request
    one = api.http.get(f"/v1/jobs/{job_id}/logs")

    # Then the answer is one chunk, which says the size and where the next one starts
    assert one.status_code == 200
    assert int(one.headers["X-E31-Log-Size"]) == len(whole)
    if not capped:
        assert one.content == whole       # the attack: everything in one response
    else:
        assert one.content == whole[:1024]
        assert int(one.headers["X-E31-Next-Offset"]) == 1024

    # And a range asked for with offset and limit is exactly those bytes, never more than
    # a chunk, of one attempt or of the whole
    part = api.http.get(f"/v1/jobs/{job_id}/logs",
                        params={"attempt": 2, "offset": 1000, "limit": 5000})
    assert part.content == texts[1][1000:2024 if capped else 6000]
    assert int(part.headers["X-E31-Log-Size"]) == len(texts[1])
    past = api.http.get(f"/v1/jobs/{job_id}/logs", params={"offset": 10**6})
    assert (past.status_code, past.content) == (200, b"")
    assert api.http.get(f"/v1/jobs/{job_id}/logs", params={"limit": 0}).status_code == 422

    # And the client reads it chunk after chunk and puts it back together exactly, even
    # where a chunk ends inside a character
    job = api.client.get(job_id)
    assert job.logs() == whole.decode()
    assert job.logs(attempt=3) == texts[2].decode()
    assert job.logs(attempt=3, offset=4000) == texts[2][4000:].decode("utf-8", "replace")
    chunks = list(job.log_chunks())
    assert b"".join(chunks) == whole
    assert max(len(c) for c in chunks) == (1024 if capped else len(whole))
    assert job.logs(attempt=9) == ""


# -- outputs per job and per tenant ---------------------------------------------------------

def test_an_output_over_the_jobs_cap_is_not_stored_and_the_log_says_why(
        capped: bool, repo: Repo, redis_client: redis.Redis, store: ArtifactStore,
        tmp_path: Path) -> None:
    # Given a job that leaves a small output and a big one, under a per-job cap of 2000 bytes
    tenant, _ = repo.create_tenant("t", now=utcnow())
    job_id = submit(repo, tenant.id, 'cd "$E31_OUTPUT_DIR" && echo small > a-small.txt'
                                     ' && head -c 3000 /dev/zero > b-big.bin')
    svc = services(repo, redis_client, store, tmp_path,
                   job_outputs_max_bytes=2000 if capped else HUGE)

    # When it runs on a real worker
    state = run_to_the_end(repo, svc, job_id)

    # Then the small output is stored; the big one only without the cap
    record = repo.get_job(None, job_id)
    stored = {o["path"]: o["size"] for o in store.list_outputs(tenant.id, job_id)}
    log = read_log(store, tenant.id, job_id, 1).decode()
    if not capped:
        assert stored == {"a-small.txt": 6, "b-big.bin": 3000}   # the attack
        return
    # and the job still succeeds, its log naming the refused file and the cap
    assert state == "succeeded"
    assert stored == {"a-small.txt": 6} and record.outputs == [{"path": "a-small.txt", "size": 6}]
    assert ("output refused: b-big.bin: 3000 bytes: over the job's outputs quota "
            "(job_outputs_max_bytes=2000)") in log
    assert repo.charge_outputs(tenant.id, [], default_max_bytes=0).used_bytes == 6


def test_a_tenant_over_its_outputs_quota_stores_no_more(
        capped: bool, repo: Repo, redis_client: redis.Redis, store: ArtifactStore,
        tmp_path: Path) -> None:
    # Given a tenant with an outputs quota of its own of 5000 bytes (or a huge one), that
    # has stored 4000 bytes of outputs already
    tenant, _ = repo.create_tenant("t", now=utcnow())
    repo.set_outputs_quota("t", 5000 if capped else HUGE)
    svc = services(repo, redis_client, store, tmp_path, tenant_outputs_max_bytes=HUGE)
    first = submit(repo, tenant.id, 'head -c 4000 /dev/zero > "$E31_OUTPUT_DIR/first.bin"')
    assert run_to_the_end(repo, svc, first) == "succeeded"

    # When another of its jobs leaves 2000 bytes more (the pool's default cap is huge: the
    # tenant's own wins)
    second = submit(repo, tenant.id, 'head -c 2000 /dev/zero > "$E31_OUTPUT_DIR/second.bin"')
    state = run_to_the_end(repo, svc, second)

    # Then the second output is not stored, and its log says it was over the tenant's quota
    stored = store.list_outputs(tenant.id, second)
    used = repo.charge_outputs(tenant.id, [], default_max_bytes=0).used_bytes
    if not capped:
        assert stored == [{"path": "second.bin", "size": 2000}] and used == 6000  # the attack
        return
    assert state == "succeeded" and stored == [] and used == 4000
    assert ("output refused: second.bin: 2000 bytes: over the tenant's outputs quota "
            "(5000 bytes, 4000 in use)") in read_log(store, tenant.id, second, 1).decode()


def test_a_retry_that_replaces_an_output_is_charged_the_difference_only(
        repo: Repo, redis_client: redis.Redis, store: ArtifactStore, tmp_path: Path) -> None:
    # Given a job that leaves the same 3000-byte output in each of its two attempts, under a
    # tenant quota of 5000 bytes (two full copies would be 6000)
    tenant, _ = repo.create_tenant("t", now=utcnow())
    repo.set_outputs_quota("t", 5000)
    job_id = submit(repo, tenant.id, 'head -c 3000 /dev/zero > "$E31_OUTPUT_DIR/model.bin"; '
                                     '[ "$E31_ATTEMPT" = 2 ]', retries={"max": 1, "backoff_s": 0})
    svc = services(repo, redis_client, store, tmp_path)

    # When both attempts run
    assert run_to_the_end(repo, svc, job_id) == "succeeded"

    # Then the second attempt's copy replaced the first, and the tenant is charged once
    assert store.list_outputs(tenant.id, job_id) == [{"path": "model.bin", "size": 3000}]
    assert repo.charge_outputs(tenant.id, [], default_max_bytes=0).used_bytes == 3000
    assert "refused" not in read_log(store, tenant.id, job_id, 2).decode()
