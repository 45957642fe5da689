"""What a footage chunk reads of a local video, against the copy it used to stage.

Renders one clip (`--seconds` at 30 fps, 320x240), then decodes it chunk by chunk
(`--chunk-s`, sampled at 1 fps, as the fan-out's chunk jobs do: from the seek point before
the chunk to its end) and counts the bytes each chunk read (`rchar` of /proc/self/io).
Before a chunk job's local input was bound read-only (docs/workloads.md, "Forty hours of
footage"), each chunk's staging copied the whole file first; now it copies nothing.

    python bench/footage_chunk_reads.py                  # 10 minutes in 100 s chunks
    python bench/footage_chunk_reads.py --smoke --out reads.json   # the suite's: 2 minutes in 30 s

`--out FILE` writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from e31.core.footage import chunk_bounds
from e31_worker.workloads.video import render_test_video, sampled_frames

from report import parse, save

SMOKE = {"seconds": 120.0, "chunk_s": 30.0}   # smaller clips: the container dominates


def read_bytes() -> int:
    """Bytes this process has read so far (read(2) and the like, cache hits included)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise RuntimeError("no rchar in /proc/self/io")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--chunk-s", type=float, default=100.0)
    args = parse(parser, SMOKE)
    with tempfile.TemporaryDirectory(prefix="e31-bench-reads-") as tmp:
        clip = render_test_video(Path(tmp) / "clip.mp4", seconds=args.seconds, fps=30,
                                 size=(320, 240))
        size = clip.stat().st_size
        chunks = chunk_bounds(args.seconds, args.chunk_s)
        print(f"{args.seconds:g} s clip, {size:,} bytes, {len(chunks)} chunks of "
              f"{args.chunk_s:g} s; staging copied {size:,} bytes a chunk before, 0 now")
        total = 0
        report: dict[str, Any] = {"seconds": args.seconds, "chunk_s": args.chunk_s,
                                  "file_bytes": size, "chunks": []}
        for start, end in chunks:
            before = read_bytes()
            frames = sum(1 for _ in sampled_frames(str(clip), fps=1, start_s=start, end_s=end,
                                                   size=(64, 48)))
            read = read_bytes() - before
            total += read
            report["chunks"].append({"start_s": start, "end_s": end, "frames": frames,
                                     "read_bytes": read})
            print(f"chunk [{start:g}, {end:g}) s: {frames} frames, read {read:,} bytes "
                  f"({read / size:.3f} of the file; its share {(end - start) / args.seconds:.3f})")
        print(f"all chunks read {total:,} bytes ({total / size:.2f}x the file); "
              f"staging copies before: {size * len(chunks):,} bytes ({len(chunks)}x)")
        report.update(read_bytes=total, staged_bytes_before=size * len(chunks))
        save(args, report)


if __name__ == "__main__":
    main()
