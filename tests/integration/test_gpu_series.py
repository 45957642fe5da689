"""A job's GPU series (`e31.ops.gpuseries`) on a real Redis: points from a busy worker's
heartbeat, bounded and expiring, none from an idle one; read back oldest first."""

from __future__ import annotations

import redis

from e31.core import keys
from e31.ops import gpuseries
from e31.ops.heartbeat import GpuSample, WorkerInfo

GIB = 1 << 30


def busy(job_id: str | None, *, util: float = 50.0, used_gib: int = 10) -> WorkerInfo:
    samples = tuple(GpuSample(index=i, util_pct=util, mem_used_bytes=used_gib * GIB,
                              mem_total_bytes=24 * GIB) for i in (0, 1))
    return WorkerInfo(node="gpu0@host", queues=("e31.gpu24",), gpus="0,1", gpu_count=2,
                      busy_job=job_id, gpus_telemetry=samples)


def test_a_busy_workers_readings_become_its_jobs_points_summed_over_its_gpus(
        redis_client: redis.Redis) -> None:
    gpuseries.record(redis_client, busy("j-0123456789abcdef0123", util=40.0))
    gpuseries.record(redis_client, busy("j-0123456789abcdef0123", util=60.0, used_gib=12))
    points = gpuseries.read(redis_client, "j-0123456789abcdef0123")
    assert [p["util_pct"] for p in points] == [40.0, 60.0]
    assert points[1]["mem_used_bytes"] == 24 * GIB and points[1]["mem_total_bytes"] == 48 * GIB
    assert points[0]["t"] <= points[1]["t"] and points[0]["node"] == "gpu0@host"
    assert 0 < redis_client.ttl(keys.gpu_series("j-0123456789abcdef0123")) <= gpuseries.TTL_S


def test_the_series_keeps_only_the_newest_points(redis_client: redis.Redis) -> None:
    for i in range(gpuseries.MAX_POINTS + 5):
        gpuseries.record(redis_client, busy("j-1111111111aaaaaaaaaa", util=float(i % 100)))
    points = gpuseries.read(redis_client, "j-1111111111aaaaaaaaaa")
    assert len(points) == gpuseries.MAX_POINTS
    assert points[-1]["util_pct"] == float((gpuseries.MAX_POINTS + 4) % 100)


def test_an_idle_worker_or_one_without_readings_records_nothing(
        redis_client: redis.Redis) -> None:
    gpuseries.record(redis_client, busy(None))
    gpuseries.record(redis_client, WorkerInfo(node="cpu0@host", queues=("e31.cpu",), gpus="",
                                              busy_job="j-2222222222bbbbbbbbbb"))
    assert gpuseries.read(redis_client, "j-2222222222bbbbbbbbbb") == []
    assert not list(redis_client.scan_iter(match=f"{keys.GPU_SERIES_PREFIX}*"))


def test_a_busy_workers_beats_add_a_point_at_most_every_step(redis_client: redis.Redis) -> None:
    from e31_worker.node.heartbeat import Heartbeat
    from e31_worker.node.telemetry import open_monitor

    # Given a worker with one simulated 24 GB GPU, busy with a job
    monitor = open_monitor([0], simulated_mem_gb=[24.0], max_age_s=0.0)
    beat = Heartbeat(redis_client=redis_client,
                     identity=WorkerInfo(node="gpu0@series-test", queues=("e31.gpu24",),
                                         gpus="0"),
                     interval_s=0.05, on_drain=lambda: None, drain_authorized=lambda: False,
                     gpus=monitor)
    beat.set_busy("j-3333333333cccccccccc")
    # When it beats again and again within one step
    for _ in range(5):
        beat.beat()
    # Then its job has one point (the first beat's), the GPU's memory held by the job
    [point] = gpuseries.read(redis_client, "j-3333333333cccccccccc")
    assert point["node"] == "gpu0@series-test" and point["mem_total_bytes"] > 0
    # And a new job's series starts at once
    beat.set_busy("j-4444444444dddddddddd")
    assert len(gpuseries.read(redis_client, "j-4444444444dddddddddd")) == 1
