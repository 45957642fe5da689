"""Submit checks `after:` dependencies before its write transaction opens, in bulk, and
inside it reads again only what can have changed: real SQLite and PostgreSQL.

A dependency that ends between the check and the write is seen as it is at the write (the
`between` fixture ends it there); a refused request opens no write transaction; a request's
statements are a few per 500 ids, not one per id.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import event, func, select

from e31.core.clock import utcnow
from e31.core.errors import SpecError
from e31.core.sizeclasses import route
from e31.core.spec import JobSpec
from e31.core.states import AttemptReason
from e31.edge.settings import Settings
from e31.store import Repo
from e31.store.bulk import SQLITE_VARIABLES_MAX
from e31.store.db import WRITE_OPTION
from e31.store.models import Job, JobDep
from e31.store.rows import CHUNK
from tests.integration.test_dependencies import array, end
from tests.integration.test_fair_scheduling import one

CLASSES = Settings().size_classes


def submit_array(repo: Repo, tenant_id: str, after: list[list[str]],
                 params: dict[str, Any] | None = None) -> str:
    items = []
    for deps in after:
        spec = JobSpec.parse({"entrypoint": "pkg.mod:main", "after": deps, "params": params or {}})
        items.append((spec, route(spec, CLASSES)))
    return repo.insert_array(tenant_id, "arr", items, now=utcnow()).id


def waiting(repo: Repo, job_id: str) -> tuple[int, list[str]]:
    """The job's `deps_pending` and the dependencies it has `job_deps` rows for."""
    with repo.engine.connect() as conn:
        pending = conn.execute(select(Job.deps_pending).where(Job.id == job_id)).scalar_one()
        rows = conn.execute(select(JobDep.dep_id).where(JobDep.job_id == job_id)).scalars()
        return pending, sorted(rows)


def job_count(repo: Repo) -> int:
    with repo.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(Job)).scalar_one())


@pytest.fixture
def between(repo: Repo, monkeypatch: pytest.MonkeyPatch) -> Callable[[Callable[[], None]], None]:
    """`between(act)`: the next submit runs `act` after its dependency check, before its
    write transaction opens, as another request or worker would at that moment."""
    check = repo._check_after
    acts: list[Callable[[], None]] = []

    def check_then_act(*args: Any) -> list[list[str]]:
        checked = check(*args)
        while acts:
            acts.pop()()
        return checked

    monkeypatch.setattr(repo, "_check_after", check_then_act)
    return acts.append


@pytest.mark.parametrize("kind", ["job", "array"])
def test_a_dependency_that_succeeds_between_the_check_and_the_write_is_not_waited_for(
        repo: Repo, between: Callable[[Callable[[], None]], None], kind: str) -> None:
    # Given a queued dependency that succeeds after the submit checked it
    tenant, _ = repo.create_tenant("a", now=utcnow())
    dep, other = one(repo, tenant.id), one(repo, tenant.id)
    between(lambda: end(repo, dep))

    # When a job, or an array's items, after it and another queued job are submitted
    if kind == "job":
        jobs = [one(repo, tenant.id, after=[dep, other])]
    else:
        array_id = submit_array(repo, tenant.id, [[dep, other], [dep]])
        jobs = [item.id for item in repo.get_array(tenant.id, array_id).items or []]

    # Then they wait only for the other one: the success was seen at the write
    assert [waiting(repo, job_id) for job_id in jobs] == (
        [(1, [other])] if kind == "job" else [(1, [other]), (0, [])])


@pytest.mark.parametrize("kind", ["job", "array"])
def test_a_dependency_that_fails_between_the_check_and_the_write_refuses_the_submit(
        repo: Repo, between: Callable[[Callable[[], None]], None], kind: str) -> None:
    # Given a queued dependency that fails after the submit checked it
    tenant, _ = repo.create_tenant("a", now=utcnow())
    dep = one(repo, tenant.id, retries={"max": 0})
    between(lambda: end(repo, dep, AttemptReason.ERROR))
    before = job_count(repo)

    # When a job or an array after it is submitted, then it is refused naming the entry, as
    # a submit after it failed is, and nothing is stored
    with pytest.raises(SpecError) as refused:
        if kind == "job":
            one(repo, tenant.id, after=[dep])
        else:
            submit_array(repo, tenant.id, [[], [dep]])
    field = "after[0]" if kind == "job" else "items[1].after[0]"
    assert refused.value.errors == [
        {"field": field, "reason": f"dependency {dep} failed: this job could never run"}]
    assert job_count(repo) == before


def test_an_array_dependency_is_seen_as_it_is_at_the_write(
        repo: Repo, between: Callable[[Callable[[], None]], None]) -> None:
    # Given two arrays: the last item of one succeeds, an item of the other fails, both after
    # the submit checked them
    tenant, _ = repo.create_tenant("a", now=utcnow())
    done_id, done_items = array(repo, tenant.id, 2)
    failed_id, failed_items = array(repo, tenant.id, 2, retries={"max": 0})
    end(repo, done_items[0])
    between(lambda: end(repo, done_items[1]))

    # When a job after the first is submitted, then it waits for nothing
    assert waiting(repo, one(repo, tenant.id, after=[done_id])) == (0, [])

    # When a job after the second is submitted, then it is refused naming the failed item
    between(lambda: end(repo, failed_items[0], AttemptReason.ERROR))
    with pytest.raises(SpecError) as refused:
        one(repo, tenant.id, after=[failed_id])
    assert refused.value.errors[0]["reason"] == (
        f"dependency {failed_id}: its item {failed_items[0]} did not succeed: this job could "
        "never run")


@pytest.fixture
def statements(repo: Repo) -> Iterator[dict[str, int]]:
    """Counts of the statements `repo` runs outside and inside write transactions, and of
    the write transactions begun."""
    counts = {"read": 0, "write": 0, "writes_begun": 0}

    def _begin(conn: Any) -> None:
        if conn.get_execution_options().get(WRITE_OPTION):
            counts["writes_begun"] += 1

    def _statement(conn: Any, *_: Any) -> None:
        counts["write" if conn.get_execution_options().get(WRITE_OPTION) else "read"] += 1

    event.listen(repo.engine, "begin", _begin)
    event.listen(repo.engine, "before_cursor_execute", _statement)
    yield counts
    event.remove(repo.engine, "begin", _begin)
    event.remove(repo.engine, "before_cursor_execute", _statement)


def test_a_request_checks_its_dependencies_in_bulk_and_a_refused_one_never_writes(
        repo: Repo, statements: dict[str, int]) -> None:
    # Given 2,000 queued jobs of the tenant
    n = 2_000
    tenant, _ = repo.create_tenant("a", now=utcnow())
    deps = [item.id for item in repo.get_array(
        tenant.id, submit_array(repo, tenant.id, [[]] * n)).items or []]
    chunks = math.ceil(n / CHUNK)

    # When an array of 2,000 items, each after an id that is no job, is submitted
    statements.update(read=0, write=0, writes_begun=0)
    with pytest.raises(SpecError) as refused:
        submit_array(repo, tenant.id, [[f"j-{i:020x}"] for i in range(n)])

    # Then it is refused naming the first 20 entries, after a read per 500 ids and no write
    assert len(refused.value.errors) == 20
    assert refused.value.errors[0] == {"field": "items[0].after[0]",
                                       "reason": f"no job j-{0:020x} of this tenant"}
    assert statements["writes_begun"] == statements["write"] == 0
    assert statements["read"] <= chunks + 1   # and SQLite's BEGIN

    # When an array of 2,000 items, each after one of the queued jobs, is submitted
    statements.update(read=0, write=0, writes_begun=0)
    array_id = submit_array(repo, tenant.id, [[dep] for dep in deps])

    # Then the write read a few statements per 500 ids (on PostgreSQL one more to lock them)
    # and inserted the rows in a few statements, not one per id
    assert statements["read"] <= chunks + 1 and statements["writes_begun"] == 1
    assert statements["write"] <= 2 * chunks + 6, statements
    items = repo.get_array(tenant.id, array_id).items or []
    assert [waiting(repo, item.id) for item in items[:3]] == [(1, [dep]) for dep in deps[:3]]


def test_a_large_array_is_inserted_intact_across_several_statements(repo: Repo) -> None:
    # Given more items than one SQLite statement may bind
    tenant, _ = repo.create_tenant("a", now=utcnow())
    n = SQLITE_VARIABLES_MAX // 20 + 7

    # When they are submitted as one array
    array_id = submit_array(repo, tenant.id, [[]] * n, params={"lr": 0.5, "tag": "x\u00e9"})

    # Then every item is stored, in order, with its spec and times as given
    manifest = repo.array_manifest(tenant.id, array_id)
    assert [item.index for item in manifest.items] == list(range(n))
    assert all(item.params == {"lr": 0.5, "tag": "x\u00e9"} for item in manifest.items)
    job = repo.get_job(tenant.id, manifest.items[-1].id)
    assert job.state == "queued" and job.submitted_at.tzinfo is not None
    assert job.spec["params"] == {"lr": 0.5, "tag": "x\u00e9"}
