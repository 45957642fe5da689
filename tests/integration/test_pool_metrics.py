"""A job the pool fails shows in the metrics (docs/reliability.md, "Whose failure it is";
the alert E31JobsFailedByPool reads it): a real input server that answers 503 for longer than
the pool's `infra_retries`, the worker's own task body, a real store and Redis, and the
scrape's own collector over them; a job that fails for its own code is not counted."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from pathlib import Path

import redis
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from e31.core.clock import utcnow
from e31.core.states import AttemptReason
from e31.edge.artifacts import ArtifactStore
from e31.ops.scrape import POOL_FAILURES, PoolCollector, registry, render
from e31.store import Repo
from e31_worker.attempt import task
from tests.integration.test_http_inputs import submit
from tests.integration.test_pool_failures import LOOPBACK, FlakyServer, run_until_final
from tests.integration.test_store import publish
from tests.integration.test_task import services

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(reg: CollectorRegistry) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(render(reg).decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def failed_by_pool(got: Samples, reason: str) -> float | None:
    return got.get(("e31_jobs_failed_by_pool_total",
                    tuple(sorted({"class": "cpu", "reason": reason}.items()))))


def test_a_job_the_pool_failed_is_counted_by_its_reason_and_a_users_failure_is_not(
        repo: Repo, redis_client: redis.Redis, tmp_path: Path) -> None:
    # Given a collector on a clock the test turns, and a worker whose patience with the
    # pool's own faults is two
    clock = [utcnow()]
    reg = registry(PoolCollector(reads=repo, redis_client=redis_client, classes=["cpu"],
                                 clock=lambda: clock[0]))
    svc = services(repo, redis_client, tmp_path, ArtifactStore(f"file://{tmp_path / 'a'}"))
    svc = dataclasses.replace(svc, settings=svc.settings.model_copy(
        update={"input_allowed_networks": LOOPBACK, "infra_retries": 2}))
    before = samples(reg)
    assert {failed_by_pool(before, r) for r in POOL_FAILURES} == {0.0}
    assert set(POOL_FAILURES) == {"lost", "setup_transient", "upload_failed", "worker_crashed",
                                  "gpu_fault"}

    # When a job's input server answers 503 for longer than that, and another job's code
    # exits 3 with no retries
    tenant, _ = repo.create_tenant("team-a", now=utcnow())
    with FlakyServer([503] * 5) as server:
        pooled = submit(repo, tenant.id, command=["true"], inputs={"m": server.url},
                        retries={"max": 3, "backoff_s": 0})
        run_until_final(svc, repo, pooled)
    own = submit(repo, tenant.id, command=["sh", "-c", "exit 3"], retries={"max": 0})
    task.run_job(svc, own, publish(repo, own))
    assert repo.get_job(None, pooled).to_status()["reason"] == AttemptReason.SETUP_TRANSIENT
    assert repo.get_job(None, own).to_status()["reason"] == AttemptReason.ERROR
    clock[0] = utcnow()
    after = samples(reg)

    # Then the pool's failure is counted once, under its reason; the user's is not
    assert failed_by_pool(after, "setup_transient") == 1
    assert {failed_by_pool(after, r) for r in POOL_FAILURES if r != "setup_transient"} == {0.0}
    assert after[("e31_jobs_ended_total", (("class", "cpu"), ("state", "failed"),
                                           ("tenant", "team-a")))] == 2

    # And once both ends have settled into the collector's history, still once
    for minutes in (5, 11, 30):
        clock[0] += timedelta(minutes=minutes)
        assert failed_by_pool(samples(reg), "setup_transient") == 1
