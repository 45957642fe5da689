#!/usr/bin/env bash
# The GPU path on a machine with real NVIDIA GPUs, in one short run (about 2 minutes):
#   - e31 up discovers the GPUs through NVML / nvidia-smi (no --simulate-gpus);
#   - a job sees its GPU pinned in CUDA_VISIBLE_DEVICES and runs on ctx.device == "cuda";
#   - the worker process itself never maps libcuda (CUDA only in the job's child);
#   - each worker's heartbeat carries its GPU's NVML telemetry (not simulated), and a job
#     that holds 4 GiB and keeps its GPU busy records that peak and a mean utilisation;
#   - where vLLM is installed, the llm workload through vLLM against vllm.LLM.generate
#     directly (bench/llm_vs_loop.py --engine vllm; a few more minutes).
# Usage: bash bench/gpu_check.sh   (prints a summary; exit 0 when every check holds)
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-gpu && . .venv-gpu/bin/activate
pip install -q torch==2.13.0 || pip install -q torch
pip install -q -e '.[worker,local,llm]'
export E31_HOME="$(mktemp -d)/e31" E31_API_PORT=18931 E31_FLOWER_PORT=15931
export E31_HEARTBEAT_INTERVAL_S=0.5   # GPU readings every half second
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader || true
e31 up -d --no-flower
trap 'e31 down >/dev/null 2>&1 || true' EXIT
out=$(e31 submit -e e31_worker.examples:matmul -p n=8192 -p repeats=50 --wait --json)
# 4 GiB on the GPU, kept busy for 6 s: its attempt's gpu_mem_peak_gb and gpu_util_mean.
busy=$(e31 submit --gpus 1 --wait --json -- python -c 'import time, torch
x = torch.ones(2**30, device="cuda"); end = time.time() + 6
while time.time() < end: x.mul_(1.0001)
torch.cuda.synchronize()')
echo "$busy" | python3 -c '
import json, sys
att = json.load(sys.stdin)["attempts"][0]
print("attempt", att["n"], "gpu_mem_peak_gb", att["gpu_mem_peak_gb"],
      "gpu_util_mean", att["gpu_util_mean"])
assert att["gpu_mem_peak_gb"] and att["gpu_mem_peak_gb"] >= 4.0, "no 4 GiB peak recorded"
assert att["gpu_util_mean"] and att["gpu_util_mean"] > 0, "no GPU utilisation recorded"
'
echo "$out" | python3 -c '
import json, sys, pathlib, redis
st = json.load(sys.stdin)
res, att = st["result"], st["attempts"][0]
print("job", st["id"], "class", st["size_class"], "worker", att["worker"], "gpus", att["gpus"])
print("device", res["device"], "GFLOP/s", res["gflops"])
assert res["device"] == "cuda", "the job did not get CUDA"
prof = json.loads((pathlib.Path("'"$E31_HOME"'") / "profile.json").read_text())
r = redis.Redis.from_url(prof["redis_url"])
for key in r.scan_iter(match="e31:worker:*"):
    hb = json.loads(r.get(key))
    maps = pathlib.Path(f"/proc/{hb[\"pid\"]}/maps").read_text()
    env = pathlib.Path(f"/proc/{hb[\"pid\"]}/environ").read_bytes().split(b"\0")
    pinned = [e.decode() for e in env if e.startswith(b"CUDA_VISIBLE_DEVICES=")]
    print(hb["node"], pinned, "libcuda mapped:", "libcuda" in maps)
    assert "libcuda" not in maps, "a worker process initialised CUDA"
    for g in hb.get("gpus_telemetry") or []:
        print("  NVML", g)
        assert not g["simulated"] and g["mem_total_bytes"], "no real NVML reading"
    assert hb["node"].startswith("cpu") or hb.get("gpus_telemetry"), "no GPU telemetry"
print("GPU path: all checks passed")
'
# vLLM brings its own torch build, so it is not installed here by default: pip install -e '.[llm-vllm]'
if python3 -c 'import vllm' 2>/dev/null; then python3 bench/llm_vs_loop.py --engine vllm --prompts 2048 --max-tokens 64 --layers 8 --hidden 1024 --repeats 1; else echo "llm vs vLLM: skipped, vllm is not installed in .venv-gpu (pip install -e '.[llm-vllm]' to run it)"; fi
