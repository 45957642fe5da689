"""The heartbeat record carries its GPUs' latest telemetry: written and read back whole, and
a heartbeat without it (an older worker) or with a malformed entry still reads."""

from __future__ import annotations

import json

from e31.ops.heartbeat import GpuSample, WorkerInfo

WORKER = WorkerInfo(node="gpu0-1@h", queues=("e31.gpu24.x2",), gpus="0,1", gpu_count=2,
                    size_class="gpu24")


def test_a_heartbeat_carries_each_gpus_sample_and_reads_back_equal() -> None:
    # Given a worker with a real and a simulated reading
    samples = (GpuSample(index=0, util_pct=87.0, mem_used_bytes=11 * 2**30,
                         mem_total_bytes=80 * 2**30, temperature_c=61.0, power_w=312.5,
                         xid_errors=1, last_xid=79, ecc_errors=0),
               GpuSample(index=1, util_pct=0.0, simulated=True))
    info = WORKER.with_telemetry(samples)

    # When it is written and read back
    raw = info.to_json()

    # Then every value survives, as plain JSON
    assert WorkerInfo.from_json(raw) == info
    assert json.loads(raw)["gpus_telemetry"][0]["last_xid"] == 79


def test_an_older_heartbeat_without_telemetry_still_reads() -> None:
    raw = json.dumps({"node": "gpu0@h", "queues": ["e31.gpu24"], "gpus": "0"})
    assert WorkerInfo.from_json(raw).gpus_telemetry == ()


def test_a_malformed_sample_is_skipped_and_unknown_keys_are_ignored() -> None:
    raw = json.dumps({"node": "gpu0@h", "queues": ["e31.gpu24"], "gpus": "0",
                      "gpus_telemetry": [{"index": "0"}, 7, {"index": 0, "fan_pct": 40,
                                                             "util_pct": 5.0}]})
    assert WorkerInfo.from_json(raw).gpus_telemetry == (GpuSample(index=0, util_pct=5.0),)
