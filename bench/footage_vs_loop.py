"""Footage throughput: the built-in workload against a hand-written PyAV + torch loop.

The same rendered clips (`render_test_video`, `--clips` of `--seconds` at 30 fps,
`--width`x`--height`), the same model (`frame_classifier`), the same sampling (`--fps`; every
frame when 0), the same resize on decode (`--size`) and batch size. Three measurements, in
frames per second:

1. **hand**: the loop one would write: open each clip with PyAV, decode, keep the frames on
   the grid, convert to RGB at the model's size, stack batches, run the model under
   `torch.inference_mode`, write one JSON row per frame. In this process.
2. **workload, one worker**: `e31_worker.workloads.footage:run`, the entrypoint's own
   function, in this process with a `JobContext` on fresh directories (what a worker's
   child runs), over the same clips. Repetitions alternate the order of 1 and 2; medians.
3. **fan-out, N workers** (`--workers`, unless 0): a private `e31 up --cpu-slots N` stack,
   one `client.submit(workload="footage", params={"source": DIR, "chunk_s": ...})`: the
   wall time from the submit to the merge job's end (planning, queueing, every chunk job's
   start, the merge: all counted), against the hand loop's time for the same frames.

Threads: torch gets `--threads` intra-op threads on every side (default 1; a chunk job gets
OMP_NUM_THREADS=1 too). The workload decodes on a background thread beside the model.

Two framings of "one worker" (`--framing`, default both, alternating within each
repetition): **free**, both sides may use every core of the machine (FFmpeg's frame threads
then decode on all of them, so the hand loop is a whole machine); and **one core**, both
sides pinned to one core (`os.sched_setaffinity`, which FFmpeg's automatic thread count
follows: one decode thread on each side), as one worker is one GPU. The fan-out's two
workers are compared with both hand-loop figures.

The machine's own ceiling for two workers (one-core framing, with two or more cores and
clips): **two hand loops side by side**, two fresh processes (spawned: a fork of this one
would inherit PyAV's scaler with its slice threads gone and wait for them forever), each
pinned to its own core over half of the clips. Two cores of a virtual machine are not twice
one core (they share caches and memory bandwidth, and the host's other guests take turns on
them), so the fan-out's ratio is read against this one as well.

    python bench/footage_vs_loop.py                       # 2 clips x 2 min, 30 fps, 2 workers
    python bench/footage_vs_loop.py --fps 0 --repeats 3   # every frame
    python bench/footage_vs_loop.py --preload e31_worker.workloads.footage   # warm imports
    python bench/footage_vs_loop.py --seconds 3600 --chunk-s 1800 --framing one-core \
        --repeats 3 --preload e31_worker.workloads.footage   # 2 x 1 h against the ceiling
    python bench/footage_vs_loop.py --smoke --out footage.json   # the suite's run (tests/bench)

`--smoke`: 2 clips of 4 s sampled at 2 fps, one repetition, a fan-out over one worker in
4 s chunks. `--out FILE` writes the medians, the frames and the ratios as JSON.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import av
import numpy
import torch

sys.path.insert(0, str(Path(__file__).parent))

from e31.core.footage import Sampler
from e31_worker.workloads import footage
from e31_worker.workloads.models import frame_classifier

from report import parse, save
from stack import job_context

SMOKE = {"clips": 2, "seconds": 4.0, "fps": 2.0, "repeats": 1, "workers": 1, "chunk_s": 4.0}


def _flush(model: Any, names: Any, name: str, times: list[float],
           images: list[numpy.ndarray], out: Any) -> int:
    x = torch.from_numpy(numpy.stack(images)).permute(0, 3, 1, 2).float().div_(255)
    score, label = model(x).float().softmax(-1).max(-1)
    out.write("".join(json.dumps({"file": name, "t_s": round(t, 6), "label": names[i],
                                  "score": s}) + "\n"
                      for t, i, s in zip(times, label.tolist(), score.tolist(), strict=True)))
    return len(images)


def hand_loop(clips: list[Path], out_dir: Path, fps: float | None, size: tuple[int, int],
              batch_size: int) -> int:
    """Decode, sample, resize, batch, forward, write: by hand. Returns the frames."""
    model = frame_classifier().eval()
    names = model.labels
    frames = 0
    with open(out_dir / "frames.jsonl", "w") as out, torch.inference_mode():
        for clip in clips:
            sampler = Sampler(fps)
            times: list[float] = []
            images: list[numpy.ndarray] = []
            with av.open(str(clip)) as container:
                stream = container.streams.video[0]
                stream.thread_type = "AUTO"
                for frame in container.decode(stream):
                    if frame.time is None or not sampler.keep(frame.time):
                        continue
                    times.append(float(frame.time))
                    images.append(frame.to_ndarray(format="rgb24", width=size[0],
                                                   height=size[1]))
                    if len(images) == batch_size:
                        frames += _flush(model, names, clip.name, times, images, out)
                        times, images = [], []
            if images:
                frames += _flush(model, names, clip.name, times, images, out)
    return frames


def hand_pair(clips: list[Path], out_dir: Path, fps: float | None, size: tuple[int, int],
              batch_size: int, cores: list[int]) -> tuple[float, int]:
    """Two hand loops side by side, each pinned to its own core over half of the clips (the
    even ones, the odd ones): what two workers could do on this machine with no platform at
    all, its two-core ceiling. Wall seconds from their common start to the later one's end,
    and the frames they wrote."""
    # Spawned, not forked: this process has decoded already, and FFmpeg's scaler (swscale 9
    # and later) keeps slice threads a fork does not copy, so a forked child's first frame
    # waits for them forever. Each side has imported and run the model once by the common
    # start line.
    ctx = multiprocessing.get_context("spawn")
    start_line = ctx.Barrier(3)
    procs = []
    for i, core in enumerate(cores[:2]):
        out = out_dir / f"side{i}"
        out.mkdir()
        procs.append(ctx.Process(target=_pinned_hand, args=(
            core, clips[i::2], out, fps, size, batch_size, start_line)))
        procs[-1].start()
    start_line.wait()
    start = time.perf_counter()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        sys.exit(f"a side-by-side hand loop failed: exit codes {[p.exitcode for p in procs]}")
    wall = max(float((out_dir / f"side{i}" / "end").read_text()) for i in range(len(procs))) - start
    frames = sum(sum(1 for _ in open(out_dir / f"side{i}" / "frames.jsonl"))
                 for i in range(len(procs)))
    return wall, frames


def _pinned_hand(core: int, clips: list[Path], out: Path, fps: float | None,
                 size: tuple[int, int], batch_size: int, start_line: Any) -> None:
    os.sched_setaffinity(0, {core})
    with torch.inference_mode():   # a fresh process: its first forward's one-time costs
        frame_classifier().eval()(torch.zeros(batch_size, 3, size[1], size[0]))
    start_line.wait()
    hand_loop(clips, out, fps, size, batch_size)
    # the end, on the machine's monotonic clock: a spawned interpreter's teardown is not work
    (out / "end").write_text(repr(time.perf_counter()))


def workload(clips: list[Path], root: Path, fps: float | None, size: tuple[int, int],
             batch_size: int) -> int:
    """The entrypoint's own function, in-process, with a JobContext on fresh directories."""
    ctx = job_context(root)
    result = footage.run(ctx, path=[str(c) for c in clips], fps=fps, size=list(size),
                         batch_size=batch_size)
    return int(result["frames"])


def fan_out(home: Path, source: Path, workers: int, params: dict[str, Any],
            preload: str = "") -> tuple[float, int]:
    """Wall seconds from the submit to the merge's end, through a private stack whose warm
    processes also import `preload` (E31_PRELOAD); frames."""
    from stack import private_stack
    env = {"OMP_NUM_THREADS": "1"}
    up = ["--cpu-slots", str(workers)]
    settings = {"E31_INPUT_FILE_ROOTS": str(source),   # the stack reads the clips there
                "E31_PRELOAD": preload}
    with private_stack(home, up, settings=settings) as client:
        # Every slot runs one short footage job first: the measured run starts warm, as a
        # pool that has been up a while does (a cold start imports torch and PyAV).
        first = sorted(source.iterdir())[0]
        warm = [client.submit(workload="footage", params={"path": "clip.mp4", "end_s": 1.0},
                              inputs={"clip.mp4": f"file://{first}"}, resources={"gpus": 0},
                              env=env) for _ in range(workers)]
        for w in warm:
            w.wait(timeout=600)
        start = time.perf_counter()
        job = client.submit(workload="footage", params={"source": str(source), **params},
                            resources={"gpus": 0}, env=env)
        status = job.wait(timeout=3600)
        wall = time.perf_counter() - start
        items = [client.get(i["id"]).status()
                 for i in client.get_array(status["after"][0]).status()["items"]]
        for st in [*items, status]:
            a = st["attempts"][-1]
            print(f"  {st['name']:<14} queued {st['queued_seconds']:6.2f} s  run "
                  f"{st['run_seconds']:6.2f} s  setup {a['setup_s'] or 0:5.2f} s  "
                  f"start {a['start']} {a['start_ms'] or 0:.0f} ms  "
                  f"job {st['result'].get('seconds', 0):6.2f} s")
        return wall, int(status["result"]["frames"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clips", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--width", type=int, default=320)
    parser.add_argument("--height", type=int, default=240)
    parser.add_argument("--fps", type=float, default=10.0, help="sampled frames a second; 0: all")
    parser.add_argument("--size", default="64x48", help="the model's input, resized on decode")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--workers", type=int, default=2, help="fan-out workers; 0: skip")
    parser.add_argument("--chunk-s", type=float, default=60.0)
    parser.add_argument("--framing", choices=("both", "free", "one-core"), default="both",
                        help="free: every core; one-core: each side pinned to one core")
    parser.add_argument("--core", type=int, default=0, help="the core of the one-core framing")
    parser.add_argument("--preload", default="",
                        help="also time the fan-out with the stack's warm processes importing "
                             "these modules (E31_PRELOAD), e.g. e31_worker.workloads.footage")
    args = parse(parser, SMOKE)
    torch.set_num_threads(args.threads)
    fps = args.fps or None
    w, h = (int(v) for v in args.size.split("x"))
    every_core = os.sched_getaffinity(0)
    framings = ["free", "one-core"] if args.framing == "both" else [args.framing]
    tmp = Path(tempfile.mkdtemp(prefix="e31-bench-footage-"))
    tmp.chmod(0o755)   # a chunk job's uid reads the clips where they are (bound read-only)
    report: dict[str, Any] = {"clips": args.clips, "seconds": args.seconds, "fps": args.fps,
                              "repeats": args.repeats, "workers": args.workers}
    try:
        source = tmp / "clips"
        source.mkdir(mode=0o755)
        clips = [footage.render_test_video(source / f"clip{i}.mp4", seconds=args.seconds, fps=30,
                                           size=(args.width, args.height))
                 for i in range(args.clips)]
        pair = "one-core" in framings and len(every_core) >= 2 and len(clips) >= 2
        runs = [(framing, side) for framing in framings for side in ("hand", "workload")]
        runs += [("one-core", "side by side")] if pair else []
        times: dict[tuple[str, str], list[float]] = {run: [] for run in runs}
        counts: dict[tuple[str, str], int] = {}
        for rep in range(args.repeats + 1):   # repetition 0 warms up and is not counted
            for framing, side in runs if rep % 2 == 0 else runs[::-1]:
                # threads made from here on (FFmpeg's, the decode thread) inherit the pinning
                os.sched_setaffinity(0, {args.core} if framing == "one-core" else every_core)
                out = tmp / f"{framing}-{side}-{rep}"
                out.mkdir()
                start = time.perf_counter()
                if side == "side by side":
                    took, counts[framing, side] = hand_pair(
                        clips, out, fps, (w, h), args.batch_size, sorted(every_core))
                else:
                    counts[framing, side] = (
                        hand_loop(clips, out, fps, (w, h), args.batch_size) if side == "hand"
                        else workload(clips, out, fps, (w, h), args.batch_size))
                    took = time.perf_counter() - start
                if rep:
                    times[framing, side].append(took)
                shutil.rmtree(out)
        os.sched_setaffinity(0, every_core)
        assert len(set(counts.values())) == 1, counts
        n = next(iter(counts.values()))
        report["frames"] = n
        print(f"clips={args.clips}x{args.seconds:g}s@30fps {args.width}x{args.height} "
              f"sampled at {args.fps:g} fps -> {n} frames, model input {w}x{h}, "
              f"batch {args.batch_size}, torch threads {args.threads}, repeats {args.repeats}, "
              f"{len(every_core)} cores, load average {os.getloadavg()[0]:.1f}")
        hands: dict[str, float] = {}
        for framing in framings:
            hand = statistics.median(times[framing, "hand"])
            work = statistics.median(times[framing, "workload"])
            hands[framing] = hand
            report[framing] = {"hand_s": hand, "workload_s": work,
                               "ratio_workload_over_hand": hand / work}
            print(f"[{framing}] hand-written loop:    median {hand:.3f} s  "
                  f"{n / hand:,.0f} frames/s  (all: {_list(times[framing, 'hand'])})")
            print(f"[{framing}] workload, one worker: median {work:.3f} s  "
                  f"{n / work:,.0f} frames/s  (all: {_list(times[framing, 'workload'])})")
            print(f"[{framing}] ratio workload/hand: {hand / work:.3f}")
        both = None
        if pair:
            both = statistics.median(times["one-core", "side by side"])
            report["side_by_side_s"] = both
            print(f"[one-core] two hand loops side by side, one per core: median {both:.3f} s  "
                  f"{n / both:,.0f} frames/s  (all: {_list(times['one-core', 'side by side'])})")
            print(f"[one-core] the machine's two-core ceiling (hand / side by side): "
                  f"{hands['one-core'] / both:.3f}")
        for preload in ("", args.preload) if args.preload else ("",):
            if not args.workers:
                break
            wall, frames = fan_out(tmp / f"home{len(preload)}", source, args.workers,
                                   {"chunk_s": args.chunk_s, "fps": fps, "size": [w, h],
                                    "batch_size": args.batch_size}, preload)
            assert frames == n, (frames, n)
            report.setdefault("fan_out", []).append(
                {"preload": preload, "wall_s": wall, "frames": frames,
                 "ratio_over_hand": {f: hand / wall for f, hand in hands.items()}})
            print(f"fan-out, {args.workers} workers, preload {preload or '-'}: {wall:.3f} s  "
                  f"{n / wall:,.0f} frames/s (submit to merged, "
                  f"{args.clips * args.seconds / args.chunk_s:g} chunks)")
            for framing, hand in hands.items():
                print(f"ratio fan-out/hand [{framing}]: {hand / wall:.3f}")
            if both is not None:
                print(f"fan-out, share of the two-core ceiling (side by side / fan-out): "
                      f"{both / wall:.3f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    save(args, report)


def _list(values: list[float]) -> str:
    return " ".join(f"{v:.2f}" for v in values)

if __name__ == "__main__":
    main()
