"""Batch-inference throughput: the built-in workload against a hand-written torch loop.

Both sides, in the same process and run, on the same device: build the same model with the
same factory, read the same JSONL records, parse each with `json.loads`, collate mini-batches
of the same size into one float32 tensor, run the model under `torch.inference_mode`, take
softmax / argmax, and write one JSON row per record to `results.jsonl`. The workload also
counts the records first (for progress), validates each record, reads on a background
thread, commits its rows to checkpoint segments and joins them into `results.jsonl` at the
end: that is the overhead measured. Repetitions alternate the order; medians of the wall
time (and, for reference, of the process's CPU time) are reported.

Threads: both sides run the model with the same number of torch intra-op threads
(`--threads`, default 1: on the 2-core development machine one thread is the hand-written
loop's fastest setting for this small model, and two threads collapse as soon as another
process wants a core). The workload's loader thread comes on top: overlapping the JSON work
with the model is the point of it.

    python bench/inference_vs_torch.py --records 20000 --batch-size 256 --repeats 7
    python bench/inference_vs_torch.py --smoke --out inference.json   # the suite's: 500 records

`--out FILE` writes the medians and the ratio as JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from e31_worker.child.runner import load_entrypoint
from e31_worker.workloads import batch_inference
from e31_worker.workloads.data import digits_arrays

from report import parse, save
from stack import job_context

SMOKE = {"records": 500, "batch_size": 64, "repeats": 1}
MODEL = "e31_worker.workloads.models:digits_mlp"


def write_records(path: Path, n: int) -> None:
    """`n` digits records (the 1,797 digits repeated), as batch inference reads them."""
    x, _ = digits_arrays("all")
    pixels = [[round(v, 4) for v in row] for row in x.tolist()]
    with open(path, "w") as f:
        f.writelines(json.dumps({"custom_id": f"r-{i}", "input": pixels[i % len(pixels)]}) + "\n"
                     for i in range(n))


def hand_loop(src: Path, out_dir: Path, batch_size: int, model_kwargs: dict[str, Any]) -> int:
    """What one would write by hand: read, parse, batch, forward, write. Returns the rows."""
    model = load_entrypoint(MODEL)(**model_kwargs).eval()
    rows = 0

    def flush(batch: list[dict[str, Any]], out: Any) -> int:
        x = torch.tensor([r["input"] for r in batch], dtype=torch.float32)
        score, index = model(x).float().softmax(-1).max(-1)
        out.write("".join(json.dumps({"custom_id": r["custom_id"], "label": i, "score": s}) + "\n"
                          for r, i, s in zip(batch, index.tolist(), score.tolist(), strict=True)))
        return len(batch)

    with open(src) as f, open(out_dir / "results.jsonl", "w") as out, torch.inference_mode():
        batch: list[dict[str, Any]] = []
        for line in f:
            batch.append(json.loads(line))
            if len(batch) == batch_size:
                rows += flush(batch, out)
                batch = []
        if batch:
            rows += flush(batch, out)
    return rows


def workload(src: Path, root: Path, batch_size: int, model_kwargs: dict[str, Any],
             threads: int) -> int:
    """The entrypoint's own function, in-process, with a JobContext on fresh temp dirs."""
    ctx = job_context(root)
    result = batch_inference.run(ctx, path=str(src), model=MODEL, model_kwargs=model_kwargs,
                                 batch_size=batch_size, cpu_threads=threads)
    return int(result["succeeded"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256, help="digits_mlp hidden width")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads, both sides")
    args = parse(parser, SMOKE)
    torch.set_num_threads(args.threads)
    kwargs = {"hidden": args.hidden}
    tmp = Path(tempfile.mkdtemp(prefix="e31-bench-"))
    try:
        src = tmp / "records.jsonl"
        write_records(src, args.records)
        times: dict[str, list[float]] = {"hand": [], "workload": []}
        cpu: dict[str, list[float]] = {"hand": [], "workload": []}
        for rep in range(args.repeats + 1):  # repetition 0 warms up and is not counted
            order = ["hand", "workload"] if rep % 2 == 0 else ["workload", "hand"]
            for side in order:
                out = tmp / f"{side}-{rep}"
                out.mkdir()
                start, start_cpu = time.perf_counter(), time.process_time()
                rows = (hand_loop(src, out, args.batch_size, kwargs) if side == "hand"
                        else workload(src, out, args.batch_size, kwargs, args.threads))
                elapsed = time.perf_counter() - start
                cpu_s = time.process_time() - start_cpu
                assert rows == args.records, (side, rows)
                if rep:
                    times[side].append(elapsed)
                    cpu[side].append(cpu_s)
                shutil.rmtree(out)
        hand, work = statistics.median(times["hand"]), statistics.median(times["workload"])
        hand_cpu, work_cpu = statistics.median(cpu["hand"]), statistics.median(cpu["workload"])
        print(f"records={args.records} batch_size={args.batch_size} hidden={args.hidden} "
              f"repeats={args.repeats} torch_threads={torch.get_num_threads()}")
        print(f"hand-written loop: median {hand:.3f} s  {args.records / hand:,.0f} records/s  "
              f"(CPU {hand_cpu:.3f} s)")
        print(f"workload:          median {work:.3f} s  {args.records / work:,.0f} records/s  "
              f"(CPU {work_cpu:.3f} s, all threads)")
        print(f"ratio workload/hand (throughput): {hand / work:.3f}")
        save(args, {"records": args.records, "batch_size": args.batch_size,
                    "repeats": args.repeats, "torch_threads": torch.get_num_threads(),
                    "hand_s": hand, "workload_s": work, "hand_cpu_s": hand_cpu,
                    "workload_cpu_s": work_cpu, "ratio_workload_over_hand": hand / work})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
