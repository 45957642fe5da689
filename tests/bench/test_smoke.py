"""Every script of bench/ at its smallest (`--smoke`), so that none rots between measurements.

Each test runs one script as a user would (`python bench/X.py --smoke --out FILE`, in its own
process group), against the same real services it measures for real (its own redis-server,
`e31 up` stacks with real workers in the default sandbox, a moto S3 process, PostgreSQL
where the suite has one), then reads the figures it wrote and checks the script's own
invariants: nothing lost or run twice, both sides of a comparison ran and their ratio is a
number. The figures themselves are not judged: on a loaded 2-core machine they mean little.
docs/development.md ("The bench smoke tests") says how long they take.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import stop_process_groups

ROOT = Path(__file__).resolve().parents[2]
OUTPUT_SHOWN_CHARS = 6_000   # the end of a failed script's output, in the failure's message


def run_bench(script: str, tmp_path: Path, *args: str, timeout_s: float) -> dict[str, Any]:
    """`python bench/SCRIPT --smoke --out FILE ARGS` from the repository's root; its JSON.
    A script that outlives `timeout_s` is stopped with its process group (its stacks)."""
    out = tmp_path / "figures.json"
    log = tmp_path / "output.txt"
    # The script's own temporary directories (stacks, trails, job modules) go under one that
    # a sandboxed job's uid may traverse, unlike pytest's 0700 tmp_path, and that goes after.
    scratch = Path(tempfile.mkdtemp(prefix="e31-bench-smoke-"))
    scratch.chmod(0o755)
    try:
        with open(log, "wb") as sink:
            proc = subprocess.Popen(
                [sys.executable, f"bench/{script}", "--smoke", "--out", str(out), *args],
                cwd=ROOT, env=dict(os.environ, TMPDIR=str(scratch)), stdout=sink,
                stderr=subprocess.STDOUT, start_new_session=True)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                stop_process_groups([proc])
                pytest.fail(f"{script} ran past {timeout_s:g} s:\n"
                            f"{log.read_text()[-OUTPUT_SHOWN_CHARS:]}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    said = log.read_text()[-OUTPUT_SHOWN_CHARS:]
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{said}"
    assert out.exists(), f"{script} wrote no figures:\n{said}"
    return dict(json.loads(out.read_text()))


def a_ratio(value: object) -> bool:
    """A positive, finite number: what a comparison's ratio must be when both sides ran."""
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


@pytest.mark.timeout(150)
def test_the_soak_loses_no_job_and_runs_none_twice_while_busy_workers_are_killed(
        tmp_path: Path) -> None:
    # Given the soak at its smallest: 12 entrypoint jobs in the default sandbox, their module
    # on the workers' PYTHONPATH and their trail in a directory the stack lets them write

    # When it kills workers under them
    figures = run_bench("soak.py", tmp_path, timeout_s=140)["e31"]

    # Then every job succeeded exactly once, at least one kill hit a busy worker
    assert figures["lost"] == 0 and figures["completed_more_than_once"] == 0, figures
    assert figures["states"] == {"succeeded": figures["jobs"]}, figures
    assert figures["not_final"] == 0, figures
    assert figures["kills_of_busy_workers"] >= 1, figures


@pytest.mark.timeout(150)
def test_a_burst_runs_every_job_once_and_no_process_says_database_is_locked(
        tmp_path: Path) -> None:
    # Given a burst of jobs half on cpu slots, half on a simulated gpu24 worker
    figures = run_bench("burst.py", tmp_path, timeout_s=140)

    # Then all succeeded in one attempt, and nobody met a locked store
    assert figures["states"] == {"succeeded": figures["jobs"]}, figures
    assert figures["attempts_per_job_max"] == 1, figures
    assert figures["database_is_locked_in"] == [], figures
    assert figures["jobs_per_s"] > 0, figures


@pytest.mark.timeout(180)
def test_dispatch_runs_bare_celery_and_e31_without_loss_and_gives_their_ratios(
        tmp_path: Path) -> None:
    # Given bare Celery (a no-op and a child per task) and E31 (command and entrypoint jobs,
    # and entrypoint jobs as the items of one array)
    figures = run_bench("dispatch_vs_celery.py", tmp_path, timeout_s=170)

    # Then each side ran every job once, and the ratios are numbers
    jobs = figures["jobs"]
    for side in ("bare_celery_noop_in_process", "bare_celery_subprocess_per_task"):
        assert figures[side]["runs"] == figures[side]["distinct"] == jobs, figures[side]
    for kind in ("command", "entrypoint"):
        assert figures["e31"][kind]["succeeded_in_one_attempt"] == jobs, figures["e31"]
    assert figures["e31"]["array"]["succeeded"] == jobs, figures["e31"]["array"]
    assert figures["e31"]["array"]["lost_or_rerun"] == 0, figures["e31"]["array"]
    assert a_ratio(figures["ratio_e31_best_over_celery_noop"]), figures
    assert a_ratio(figures["ratio_e31_command_over_celery_subprocess"]), figures
    assert a_ratio(figures["ratio_e31_array_over_celery_noop"]), figures

    # And each side's CPU per job was read: the Celery workers', E31's control path
    for side in ("bare_celery_noop_in_process", "bare_celery_subprocess_per_task"):
        assert figures[side]["cpu_ms_per_job"]["workers"] > 0, figures[side]
    for kind in ("command", "entrypoint", "array"):
        assert figures["e31"][kind]["cpu_ms_per_job"]["control_path"] > 0, figures["e31"][kind]


@pytest.mark.timeout(150)
def test_the_job_path_profile_counts_cpu_sql_redis_and_http_per_job(tmp_path: Path) -> None:
    # Given tiny command jobs on a stack whose processes count what they do
    figures = run_bench("profile_job_path.py", tmp_path, timeout_s=140)

    # Then every process of the path shows its cost per job (the script refuses a lost job)
    for process in ("api", "scheduler", "worker"):
        assert figures["cpu_ms_per_job"][process] > 0, figures["cpu_ms_per_job"]
        assert figures["sql_per_job"][process] > 0, figures["sql_per_job"]
    assert figures["redis_commands_per_job"] > 0, figures
    assert figures["http_requests_per_job"] > 0, figures


@pytest.mark.timeout(120)
def test_start_latency_measures_warm_and_cold_starts_of_both_jobs(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    # Given the worker's supervisor directly (part 1 alone: 11 s; the stack's part is below)
    figures = run_bench("start_latency.py", tmp_path, "--skip-stack", timeout_s=110)

    # Then both jobs started warm and cold, each start timed
    started = {(row["job"], row["start"]) for row in figures["direct"]}
    assert started == {(job, how) for job in ("plain", "torch") for how in ("warm", "cold")}
    assert all(row["p50_ms"] > 0 for row in figures["direct"]), figures["direct"]


# slow: the whole of it (34 s of the suite's two-minute budget for bench/ on 2 cores, measured
# under load) cannot shrink: besides part 1 above it starts an `e31 up` stack and a bare
# Celery worker to read their memory.
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_start_latency_measures_warm_and_cold_starts_and_the_memory_of_workers(
        tmp_path: Path) -> None:
    pytest.importorskip("torch")
    # Given the worker's supervisor directly, then a stack and a bare Celery worker
    figures = run_bench("start_latency.py", tmp_path, timeout_s=170)

    # Then both jobs started warm and cold, the stack's jobs succeeded, memory was read
    started = {(row["job"], row["start"]) for row in figures["direct"]}
    assert started == {(job, how) for job in ("plain", "torch") for how in ("warm", "cold")}
    assert all(row["p50_ms"] > 0 for row in figures["direct"]), figures["direct"]
    stack = figures["stack"]
    assert stack["succeeded"] == stack["jobs"], stack
    assert min(*stack["worker_rss_pss_kb"], *stack["bare_celery_rss_pss_kb"]) > 0, stack


@pytest.mark.timeout(240)
def test_footage_against_the_hand_loop_counts_the_same_frames_on_every_side(
        tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("av")
    # Given two short clips: a hand-written loop, the workload in-process, and a fan-out
    figures = run_bench("footage_vs_loop.py", tmp_path, timeout_s=230)

    # Then every side ran (the script checks they saw the same frames) and the ratios are numbers
    assert figures["frames"] > 0, figures
    for framing in ("free", "one-core"):
        assert a_ratio(figures[framing]["ratio_workload_over_hand"]), figures[framing]
    [fan_out] = figures["fan_out"]
    assert fan_out["frames"] == figures["frames"], fan_out
    assert all(a_ratio(r) for r in fan_out["ratio_over_hand"].values()), fan_out


def test_batch_inference_against_the_hand_loop_gives_a_ratio(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    # Given the same records through a hand-written torch loop and the workload
    figures = run_bench("inference_vs_torch.py", tmp_path, timeout_s=170)

    # Then both sides ran (the script checks every record came back) and the ratio is a number
    assert figures["hand_s"] > 0 and figures["workload_s"] > 0, figures
    assert a_ratio(figures["ratio_workload_over_hand"]), figures


def test_the_llm_workload_against_a_hand_generate_loop_gives_a_ratio(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    # Given the same chat requests through a hand-written generate loop and the llm workload
    figures = run_bench("llm_vs_loop.py", tmp_path, timeout_s=170)

    # Then both wrote the same number of tokens (the script checks) and the ratio is a number
    assert figures["completion_tokens"] == 8 * 4, figures
    assert figures["hand_s"] > 0 and figures["workload_s"] > 0, figures
    assert a_ratio(figures["ratio_workload_over_hand"]), figures


def test_a_footage_chunk_reads_its_share_of_the_file_not_a_copy(tmp_path: Path) -> None:
    pytest.importorskip("av")
    # Given a clip decoded chunk by chunk
    figures = run_bench("footage_chunk_reads.py", tmp_path, timeout_s=170)

    # Then every chunk decoded frames, and all of them read less than staging copied
    assert len(figures["chunks"]) == 4, figures
    assert all(c["frames"] > 0 and c["read_bytes"] > 0 for c in figures["chunks"]), figures
    assert figures["read_bytes"] < figures["staged_bytes_before"], figures


def test_planning_footage_probes_one_at_a_time_and_in_parallel_locally_and_on_s3(
        tmp_path: Path) -> None:
    pytest.importorskip("av")
    pytest.importorskip("moto")
    pytest.importorskip("s3fs")
    # Given a few clips in a directory and in a moto S3 bucket
    figures = run_bench("footage_planning.py", tmp_path, timeout_s=170)

    # Then both ways were timed on both sources (the script checks every clip was planned)
    for source in ("local", "s3"):
        assert a_ratio(figures[source]["ratio_one_over_parallel"]), figures[source]


def test_the_api_fuzzed_as_a_tenant_finds_nothing(tmp_path: Path) -> None:
    pytest.importorskip("schemathesis")
    # Given `e31 api` over a fresh store, fuzzed for seconds as a tenant
    figures = run_bench("fuzz_api.py", tmp_path, timeout_s=170)

    # Then operations were tested and none failed
    tenant = figures["callers"]["tenant"]
    assert tenant["exit_status"] == 0 and tenant["failures"] == 0, tenant
    assert tenant["tested"] > 0 and tenant["generated"] > 0, tenant


def test_the_scheduler_cost_counts_a_tick_that_fills_every_idle_worker(tmp_path: Path) -> None:
    # Given a small backlog on SQLite and four idle workers' heartbeats
    figures = run_bench("scheduler_cost.py", tmp_path, timeout_s=170)

    # Then each tick dispatched one job per idle worker, and its cost was counted
    [row] = figures["rows"]
    assert row["store"] == "sqlite" and row["dispatched_per_tick"] == row["workers"], row
    assert row["sql_statements_per_tick"] > 0 and row["tick_ms"] > 0, row
    assert set(row["statements_writes_by_phase"]) == {"submit", "claim", "renew", "record"}, row


def test_the_store_calls_of_a_jobs_path_are_each_timed_and_counted(tmp_path: Path) -> None:
    # Given a fresh SQLite store: 20 jobs submitted, published, claimed, ended and read, and
    # the 20 items of one array run as a row
    figures = run_bench("store_calls.py", tmp_path, timeout_s=60)

    # Then every call was made once a job (or an item) and took some CPU; the claim is its
    # transaction's three statements, as tests/integration/test_lean_path.py bounds them
    calls = figures["per_call"]
    assert set(calls) == {"token", "submit", "mark", "claim", "outcome", "read",
                          "item outcome", "next item claim"}, calls
    assert all(c["calls"] == figures["calls"] and c["cpu_ms_mean"] > 0 for c in calls.values())
    assert calls["claim"]["statements"] == 4, calls   # BEGIN IMMEDIATE, UPDATE, UPDATE, INSERT


def test_a_cold_childs_fork_is_timed_both_ways(tmp_path: Path) -> None:
    # Given a process with a worker's imports: 10 children `true` by Popen, then by the spawner
    figures = run_bench("cold_fork.py", tmp_path, timeout_s=60)

    # Then each way started and waited for every child and has its CPU; only the spawner's
    # way spent CPU in the spawner
    [run] = figures["rounds"]
    assert figures["children"] == 10 and not figures["torch"], figures
    assert run["popen"]["worker_cpu_ms"] > 0 and run["popen"]["spawner_cpu_ms"] == 0, run
    assert run["spawner"]["wall_ms"] > 0 and run["spawner"]["spawner_cpu_ms"] >= 0, run


def test_every_console_page_answers_on_a_store_of_jobs_and_is_timed(tmp_path: Path) -> None:
    # Given a small store on SQLite, signed in to the console as its tenant
    figures = run_bench("console_pages.py", tmp_path, timeout_s=120)

    # Then every page answered (the script asserts each 200) and has a time
    assert figures["store"] == "sqlite" and figures["jobs"] == 2_000, figures
    assert len(figures["pages"]) == 10, figures
    assert all(p["median_ms"] > 0 for p in figures["pages"].values()), figures


def test_an_array_submission_refuses_unknown_dependencies_and_stores_the_rest(
        tmp_path: Path) -> None:
    # Given arrays of each shape straight into the repository
    figures = run_bench("submit_lock.py", tmp_path, timeout_s=170)

    # Then unknown ids are refused, the others stored, and each store's write was timed
    shapes = figures["shapes"]
    refused = [name for name in shapes if "unknown" in name]
    assert len(refused) == 1 and shapes.pop(refused[0])["outcome"] == "refused", shapes
    assert {shape["outcome"] for shape in shapes.values()} == {"stored"}, shapes
    assert all(shape["write_s_worst"] > 0 for shape in shapes.values()), shapes


@pytest.mark.postgres
def test_a_simulated_fleet_runs_jobs_through_the_real_scheduler_and_api(tmp_path: Path) -> None:
    server = os.environ.get("E31_TEST_DATABASE_URL")
    if not server:
        pytest.skip("E31_TEST_DATABASE_URL is not set (the fleet's store is PostgreSQL)")
    # Given the real API and scheduler processes and four simulated workers for seconds
    figures = run_bench("fleet_sim.py", tmp_path, "--postgres", server, timeout_s=170)

    # Then submits and the array were stored, the fleet ran jobs, and its load was counted
    assert figures["api_submits_per_s"] > 0 and figures["api_array_jobs_per_s"] > 0, figures
    assert figures["jobs_done"] > 0 and figures["heartbeats_per_s"] > 0, figures
    assert figures["pg_commits_per_s"] > 0, figures


def test_the_fairness_simulation_runs_fair_share_and_fifo_over_the_same_trace(
        tmp_path: Path) -> None:
    # Given the real admission policy and a FIFO baseline, on a smaller flood
    figures = run_bench("fairness/sim.py", tmp_path, timeout_s=170)

    # Then both policies ran on the pool
    assert set(figures["runs"]) == {"shared/fair", "shared/fifo"}, figures["runs"]


def test_the_node_simulation_keeps_its_placement_invariants(tmp_path: Path) -> None:
    # Given two hours of a small trace with preemption and exact reservations
    figures = run_bench("fairness/nodesim.py", tmp_path, timeout_s=170)

    # Then every variant ran (the simulation raises on a GPU given twice, a preemption it may
    # not make or a broken reservation) and none broke a reservation
    assert set(figures["runs"]) == {"flood/pack fair-res preempt",
                                    "flood/spread fair-res preempt", "steady/pack"}
    assert all(r["reservation_violations"] == 0 for r in figures["runs"].values()), figures


@pytest.mark.timeout(170)
def test_a_map_of_tiny_calls_comes_back_in_order_with_its_bundles_uploaded_once(
        tmp_path: Path) -> None:
    # Given 20 tiny items mapped by @e31.function on a stack, and as bare Celery tasks
    figures = run_bench("map_overhead.py", tmp_path, timeout_s=160)

    # Then every value came back in order, each item in one attempt, from one array, and
    # the map uploaded one bundle of calls (its code went up with the warm-up), not one per item
    ours = figures["e31_map"]
    assert ours["values_right_and_in_order"] and ours["succeeded"] == figures["items"], ours
    assert ours["bundles_uploaded"] == 1, ours
    bare = figures["bare_celery_noop"]
    assert bare["runs"] == bare["distinct"] == figures["items"], bare
    assert a_ratio(figures["ratio_e31_map_over_celery_noop"]), figures
