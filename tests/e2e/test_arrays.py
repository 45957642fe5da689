"""Arrays and sweeps against a real stack: the Python client and the `e31` command line."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from sqlalchemy import select

from e31.core import keys
from e31.store import make_engine
from e31.store.models import Attempt, Job
from tests.conftest import wait_for

from .conftest import Stack

HELLO = {"entrypoint": "e31_worker.examples:hello", "resources": {"gpus": 0}, "timeout_s": 60}


def test_a_four_item_array_runs_to_the_end_and_its_manifest_is_keyed_by_item(stack: Stack) -> None:
    client = stack.client()
    # Given three greetings and one item that fails on its only attempt
    items = [{"params": {"name": n}} for n in ("ada", "grace", "edsger")]
    items.append({"entrypoint": "e31_worker.examples:flaky", "params": {"succeed_on": 9},
                  "retries": {"max": 0}})

    # When they are submitted as one array and waited for
    array = client.submit_many(items, name="greet", **HELLO)
    status = array.wait(timeout=120)

    # Then wait returns (it does not raise for the failed item) with the whole's counts
    assert (status["total"], status["done"], status["succeeded"], status["failed"]) == (4, 4, 3, 1)
    assert status["state"] == "failed"
    assert [i["state"] for i in status["items"]] == ["succeeded"] * 3 + ["failed"]

    # And the manifest gives each item's params, result, outputs and error by index
    manifest = array.manifest()["items"]
    assert [m["index"] for m in manifest] == [0, 1, 2, 3]
    assert [m["result"]["greeting"] for m in manifest[:3]] == \
        ["hello, ada", "hello, grace", "hello, edsger"]
    assert manifest[1]["outputs"] == [{"path": "greeting.txt", "size": len("hello, grace\n")}]
    assert manifest[3]["state"] == "failed" and "fails on purpose" in manifest[3]["error"]

    # And every item is a job of its own, with its place in the array
    jobs = array.jobs()
    assert [j.id for j in jobs] == array.job_ids
    job = jobs[2].status()
    assert (job["name"], job["array_id"], job["array_index"]) == ("greet[2]", array.id, 2)


def test_cancelling_an_array_stops_its_running_and_queued_items(stack: Stack) -> None:
    client = stack.client()
    # Given six long sleeps on a pool with two cpu slots: some run, the rest wait
    array = client.submit_many([{"params": {"seconds": 120, "steps": 120}}] * 6, name="sleepy",
                               entrypoint="e31_worker.examples:sleep", resources={"gpus": 0})
    wait_for(lambda: array.status(items=False)["running"] >= 1, timeout_s=60,
             what="an item of the array to run")

    # When the whole array is cancelled
    array.cancel()

    # Then every item ends cancelled within seconds, the running ones killed by their workers
    final = wait_for(lambda: (s := array.status())["done"] == 6 and s, timeout_s=60,
                     what="every item to end")
    assert isinstance(final, dict)
    assert (final["state"], final["cancelled"]) == ("cancelled", 6)


def test_the_cli_submits_a_sweep_over_a_spec_waits_and_prints_the_manifest(
        stack: Stack, tmp_path: Path) -> None:
    # Given a base spec and a grid of four names
    base = tmp_path / "greet.yaml"
    base.write_text("name: cli-sweep\nentrypoint: e31_worker.examples:hello\n"
                    "resources: {gpus: 0}\n")
    sweep = tmp_path / "names.yaml"
    sweep.write_text("grid:\n  name: [ada, grace, edsger, barbara]\n")

    # When the sweep is submitted over the spec and waited for
    submitted = stack.e31("submit", str(base), "--sweep", str(sweep))
    assert submitted.returncode == 0, submitted.stderr
    array_id = submitted.stdout.strip()
    assert array_id.startswith("a-")
    waited = stack.e31("wait", array_id, timeout_s=150)

    # Then the whole succeeded, and status, result and download speak of the four items
    assert waited.returncode == 0, waited.stderr
    assert "4/4 done" in waited.stdout
    status = json.loads(stack.e31("status", array_id, "--json").stdout)
    assert (status["name"], status["total"], status["succeeded"]) == ("cli-sweep", 4, 4)
    assert "cli-sweep" in stack.e31("status", array_id).stdout
    fetched = stack.e31("result", array_id, "--json", "--download", str(tmp_path / "dl"))
    assert fetched.returncode == 0, fetched.stderr
    manifest = json.loads(fetched.stdout)
    assert [m["params"] for m in manifest["items"]] == \
        [{"name": n} for n in ("ada", "grace", "edsger", "barbara")]
    assert (tmp_path / "dl" / "3" / "greeting.txt").read_text() == "hello, barbara\n"


def test_the_cli_waits_on_a_failing_sweep_with_exit_1_and_cancels_an_array(
        stack: Stack, tmp_path: Path) -> None:
    # Given a sweep whose second item fails
    sweep = tmp_path / "flaky.yaml"
    sweep.write_text("base: {entrypoint: e31_worker.examples:flaky, resources: {gpus: 0},"
                     " retries: {max: 0}}\nlist: [{succeed_on: 1}, {succeed_on: 5}]\n")

    # When it is submitted with --wait --json
    waited = stack.e31("submit", str(sweep), "--wait", "--json", timeout_s=150)

    # Then it exits 1, prints the status of the whole, and names the failed item on stderr
    assert waited.returncode == 1, waited.stderr
    status = json.loads(waited.stdout)
    assert (status["state"], status["succeeded"], status["failed"]) == ("failed", 1, 1)
    assert "[1]" in waited.stderr
    assert stack.e31("result", status["id"]).returncode == 1

    # And cancelling the finished array changes nothing, and says so
    cancelled = stack.e31("cancel", status["id"])
    assert cancelled.returncode == 0 and "0 cancelled" in cancelled.stdout


def test_a_bad_sweep_is_one_line_on_stderr_and_exit_2_and_nothing_is_stored(
        stack: Stack, tmp_path: Path) -> None:
    before = len(json.loads(stack.e31("ls", "--json", "--limit", "1000").stdout))
    sweep = tmp_path / "bad.yaml"
    sweep.write_text("grid:\n  lr: 0.1\n")
    refused = stack.e31("submit", "-e", "e31_worker.examples:hello", "--sweep", str(sweep))
    assert refused.returncode == 2 and refused.stderr.strip().count("\n") == 0
    assert "sweep.grid.lr" in refused.stderr

    gpu_list = tmp_path / "gpus.yaml"
    gpu_list.write_text("list: [{name: a}, {name: b}]\n")
    refused = stack.e31("submit", "-e", "e31_worker.examples:hello", "--gpus", "64",
                        "--sweep", str(gpu_list))
    assert refused.returncode == 2 and "items[0].resources.gpus" in refused.stderr
    assert len(json.loads(stack.e31("ls", "--json", "--limit", "1000").stdout)) == before
    assert stack.e31("status", "a-" + "0" * 20).returncode == 2


CHAIN_NODE = "gpu0@chainhost"


@pytest.fixture
def chaining_worker(stack: Stack) -> Iterator[Path]:
    """An extra `e31 worker` with `array_chain_items` 16 and one simulated 80 GB GPU, a class
    the stack lacks, so that only it runs gpu80 jobs; yields its log."""
    log_path = stack.home / "logs" / "chain-worker.log"
    log = open(log_path, "ab")
    proc = subprocess.Popen([sys.executable, "-m", "e31.cli", "worker", "--simulate-gpus", "1x80",
                             "--hostname", CHAIN_NODE.split("@")[1], "--loglevel", "INFO"],
                            env=stack.env_with_redis(E31_ARRAY_CHAIN_ITEMS="16"),
                            stdout=log, stderr=subprocess.STDOUT)
    r = redis.Redis.from_url(stack.redis_url)
    try:
        wait_for(lambda: r.get(keys.worker(CHAIN_NODE)), timeout_s=60, what="the gpu80 worker")
        yield log_path
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        log.close()


def test_a_worker_runs_an_arrays_next_items_in_a_row_each_its_own_attempt(
        stack: Stack, chaining_worker: Path) -> None:
    # Given a twelve-item gpu80 array, which only the worker with array_chain_items 16 serves
    client = stack.client()
    array = client.submit_many([{"params": {"name": f"n{i}"}} for i in range(12)],
                               name="in-a-row", entrypoint="e31_worker.examples:hello",
                               resources={"gpu_mem_gb": 80}, timeout_s=60)

    # When it runs to the end
    status = array.wait(timeout=120)

    # Then every item succeeded in one attempt, in its own sandbox and attempt record
    assert (status["total"], status["succeeded"]) == (12, 12)
    engine = make_engine(f"sqlite:///{stack.home / 'e31.db'}")
    try:
        with engine.connect() as conn:
            rows = conn.execute(select(Job.id, Job.dispatch_count, Job.attempts_used)
                                .where(Job.array_id == array.id)).all()
            attempts = conn.execute(select(Attempt.job_id, Attempt.reason, Attempt.isolation,
                                           Attempt.worker)
                                    .join(Job, Job.id == Attempt.job_id)
                                    .where(Job.array_id == array.id)).all()
    finally:
        engine.dispose()
    assert sorted(r.attempts_used for r in rows) == [1] * 12
    assert sorted(a.job_id for a in attempts) == sorted(r.id for r in rows)
    assert {(a.reason, a.isolation, a.worker) for a in attempts} == \
        {("succeeded", "sandbox", CHAIN_NODE)}
    # and the worker claimed most of them right after the one before, never published:
    # without the row every item is a publication of the scheduler's (dispatch_count 1)
    in_a_row = [r.id for r in rows if r.dispatch_count == 0]
    assert len(in_a_row) >= 6, rows
    log = chaining_worker.read_text(errors="replace").splitlines()
    chained = {line.split(" job=")[1].split()[0] for line in log
               if "job_claimed" in line and "chained_after=" in line}
    assert set(in_a_row) <= chained


def test_the_stacks_workers_leave_every_item_to_the_scheduler_by_default(stack: Stack) -> None:
    # Given an array on the stack's own cpu slots (array_chain_items not set: 0)
    array = stack.client().submit_many([{"params": {"name": f"n{i}"}} for i in range(4)],
                                       name="published", **HELLO)

    # When it runs to the end, then every item was published by the scheduler
    assert array.wait(timeout=120)["succeeded"] == 4
    engine = make_engine(f"sqlite:///{stack.home / 'e31.db'}")
    try:
        with engine.connect() as conn:
            counts = conn.execute(select(Job.dispatch_count)
                                  .where(Job.array_id == array.id)).scalars().all()
    finally:
        engine.dispose()
    assert sorted(counts) == [1] * 4
