"""Planning a footage source: what `POST /v1/jobs` spends on `e31.ops.fanout.plan` per file.

The API plans a `source` while the request waits: it lists the files and probes each
video's duration with PyAV. This times `plan` over `--files` short rendered clips, with the
probes one at a time (`PROBE_THREADS = 1`, as before) and `PROBE_THREADS` at a time,
alternating, medians: from a local directory, and from S3 (a `moto_server` process on this
machine, reached over HTTP with s3fs as the API would reach a bucket; `--no-s3` skips it).
A local S3 answers in about a millisecond; a real one takes tens of milliseconds a request,
so the S3 figures are a lower bound of what a bucket costs.

    python bench/footage_planning.py                  # 200 clips
    python bench/footage_planning.py --files 500 --repeats 5
    python bench/footage_planning.py --smoke --out plan.json   # the suite's run: 4 clips, once

`--out FILE` writes the medians as JSON.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from e31.ops import fanout
from e31_worker.workloads.video import render_test_video

from report import parse, save

SMOKE = {"files": 4, "repeats": 1}
PARALLEL = fanout.PROBE_THREADS   # the planner's own setting, against 1


def timed_plan(source: str, roots: tuple[str, ...], threads: int) -> tuple[float, int]:
    """Seconds `plan` took over `source` with `threads` probes at a time; chunk jobs."""
    fanout.PROBE_THREADS = threads
    start = time.perf_counter()
    planned = fanout.plan({"source": source, "chunk_s": 600}, roots=roots)
    return time.perf_counter() - start, len(planned.items)


@contextmanager
def moto_s3(clips: Path) -> Iterator[str]:
    """A moto S3 server process with the clips under s3://bench/clips/; yields that URL."""
    import fsspec

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_DEFAULT_REGION="us-east-1",
                      FSSPEC_S3_ENDPOINT_URL=f"http://127.0.0.1:{port}")
    fsspec.config.set_conf_env(fsspec.config.conf)   # read the FSSPEC_S3_* variable now
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        fs = fsspec.filesystem("s3")
        fs.mkdir("bench")
        fs.put(str(clips) + "/", "bench/clips/", recursive=True)
        fs.invalidate_cache()
        yield "s3://bench/clips/"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def compare(what: str, source: str, roots: tuple[str, ...], files: int,
            repeats: int) -> dict[str, float]:
    times: dict[int, list[float]] = {1: [], PARALLEL: []}
    for rep in range(repeats + 1):   # repetition 0 warms up (imports, caches) and is not counted
        for threads in (1, PARALLEL) if rep % 2 else (PARALLEL, 1):
            seconds, items = timed_plan(source, roots, threads)
            assert items == files, (items, files)
            if rep:
                times[threads].append(seconds)
    one, many = statistics.median(times[1]), statistics.median(times[PARALLEL])
    print(f"{what}: {files} videos, one probe at a time: median {one:.3f} s "
          f"({one / files * 1000:.1f} ms a file); {PARALLEL} at a time: {many:.3f} s "
          f"({many / files * 1000:.1f} ms a file); {one / many:.2f}x")
    return {"one_at_a_time_s": one, "parallel_s": many, "parallel_probes": PARALLEL,
            "ratio_one_over_parallel": one / many}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-s3", action="store_true")
    args = parse(parser, SMOKE)
    report: dict[str, object] = {"files": args.files, "repeats": args.repeats}
    tmp = Path(tempfile.mkdtemp(prefix="e31-bench-planning-"))
    try:
        clips = tmp / "clips"
        clips.mkdir()
        first = render_test_video(clips / "cam0000.mp4", seconds=2, fps=10)
        for i in range(1, args.files):
            shutil.copyfile(first, clips / f"cam{i:04d}.mp4")
        print(f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores")
        report["local"] = compare("local", str(clips), (str(tmp),), args.files, args.repeats)
        if not args.no_s3:
            with moto_s3(clips) as url:
                report["s3"] = compare("s3 (moto, local)", url, (), args.files, args.repeats)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    save(args, report)


if __name__ == "__main__":
    main()
