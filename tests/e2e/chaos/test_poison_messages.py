"""Poison and malformed input at the worker: each is logged with its reason, nothing
crashes, and the same worker process keeps serving."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kombu import Connection, Exchange, Producer

from e31.core.errors import JobFailed
from e31.edge.celeryapp import broker_transport_options, make_celery
from e31.edge.settings import Settings
from tests.conftest import wait_for

from .conftest import Cluster, make_cluster

LOG_MAX_BYTES = 1 << 20
QUEUE = "e31.node.ha"   # the queue of the host's gang workers (the default layout)


@pytest.fixture(scope="module")
def one_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    cluster = make_cluster(tmp_path_factory.mktemp("poison"), E31_LOG_MAX_BYTES=str(LOG_MAX_BYTES))
    try:
        cluster.start(hosts=("ha",))
        yield cluster
    finally:
        cluster.stop()


def _publish_raw(cluster: Cluster, body: bytes | dict, *, content_type: str,
                 headers: dict | None = None) -> None:
    options = broker_transport_options(Settings(redis_url=cluster.redis.url))
    with Connection(cluster.redis.url, transport_options=options) as conn:
        Producer(conn.default_channel).publish(
            body, exchange=Exchange(QUEUE, type="direct"), routing_key=QUEUE,
            content_type=content_type,
            content_encoding="binary" if content_type.endswith("serialize") else "utf-8",
            headers=headers or {}, declare=[], serializer=None)


def test_malformed_and_unknown_messages_are_logged_and_the_worker_keeps_serving(
        one_host: Cluster) -> None:
    cluster = one_host
    beat = cluster.heartbeat("ha")
    assert beat is not None
    celery = make_celery(Settings(redis_url=cluster.redis.url))
    # Given messages no scheduler would send: an unknown job, one without a dispatch token, a
    # payload that is not a job id, a task nobody registered, a pickled body (refused: JSON
    # only) and a body that is no JSON
    celery.send_task("e31.run", args=["j-00000000000000000000", "no-such-token"], queue=QUEUE)
    celery.send_task("e31.run", args=["j-11111111111111111111"], queue=QUEUE)
    celery.send_task("e31.run", args=[{"not": "a job id"}], queue=QUEUE)
    celery.send_task("e31.no_such_task", args=["x"], queue=QUEUE)
    _publish_raw(cluster, b"\x80\x04K\x01.", content_type="application/x-python-serialize",
                 headers={"task": "e31.run", "id": "pickled", "argsrepr": "()"})
    _publish_raw(cluster, b"{not json", content_type="application/json",
                 headers={"task": "e31.run", "id": "garbled", "argsrepr": "()"})

    # When a real job follows them
    job = cluster.client().submit(command=["true"], resources={"gpus": 1})

    # Then it runs on the same worker process, which logged each bad message with its reason
    status = job.wait(timeout=60)
    assert status["attempts"][0]["worker"] == "gpu0@ha"
    after = cluster.heartbeat("ha")
    assert after is not None and after["pid"] == beat["pid"]
    log = cluster.log("worker-ha")
    assert "claim_skipped job=j-00000000000000000000" in log
    assert "message_unauthorized job=j-11111111111111111111" in log
    assert "message_malformed" in log
    assert "e31.no_such_task" in log
    assert "ContentDisallowed" in log or "disallowed" in log.lower()
    wait_for(lambda: "garbled" in cluster.log("worker-ha")
             or "decode" in cluster.log("worker-ha").lower(),
             timeout_s=10, what="the garbled message to be logged")


def test_a_job_that_writes_hundreds_of_megabytes_of_log_keeps_the_cap_and_says_so(
        one_host: Cluster) -> None:
    # Given a job that writes 300 MB to its output
    job = one_host.client().submit(
        command=["sh", "-c", "head -c 300000000 /dev/zero | tr '\\\\0' x"], resources={"gpus": 1})

    # When it runs
    status = job.wait(timeout=120)

    # Then it succeeds, and its stored log stops at the cap and says where and why
    assert status["state"] == "succeeded"
    text = job.logs()
    assert len(text.encode()) < LOG_MAX_BYTES + 200
    assert f"[e31: log cut at {LOG_MAX_BYTES} bytes; the rest was discarded]" in text


def test_an_unimportable_entrypoint_and_a_result_that_is_not_json_end_the_job_with_that_reason(
        one_host: Cluster) -> None:
    client = one_host.client()
    missing = client.submit(entrypoint="no_such_package_e31:main", resources={"gpus": 1})
    not_json = client.submit(entrypoint="chaosjobs:not_json", resources={"gpus": 1})

    with pytest.raises(JobFailed) as first:
        missing.wait(timeout=60)
    with pytest.raises(JobFailed) as second:
        not_json.wait(timeout=60)

    assert "cannot import entrypoint no_such_package_e31:main" in first.value.status["error"]
    assert "result is not JSON" in second.value.status["error"]
