"""`.map` of `@e31.function` over tiny items against the same items as bare Celery tasks on
the same Redis and machine, and the bytes the map uploaded; on demand.

    python bench/map_overhead.py --items 10000 --workers 2
    python bench/map_overhead.py --smoke --out map.json   # the suite's run: 20 items

One private redis-server serves both sides in turn. Bare Celery runs `--workers` worker
processes (as bench/dispatch_vs_celery.py: pool threads, concurrency 1, late ack, prefetch 1)
and N in-process no-op tasks through them. E31 runs `e31 up --cpu-slots W` on the same Redis
and maps a function (`x + 1`, defined in this script's `__main__`, so it travels by value)
over the N items: one array, each item a sandboxed job with its own attempt, record and
output file. The timer runs from the call (pickling and uploads included) to the last value
received in the caller; the time to the array's submission is reported apart.

Every value must come back right and in order; an item that failed (the pool's fault: the
function cannot fail) is counted with its reason, not hidden. The bytes uploaded are the
bundles the map sent (code and calls), once each, however many items. Prints items/s for
each side and their ratio (docs/performance.md, "A map of tiny Python calls"); `--out FILE`
writes the same JSON.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import e31
from e31.local.redisserver import start_redis

from dispatch_vs_celery import bare_celery
from report import parse, save
from stack import private_stack

SMOKE = {"items": 20, "workers": 1}


@e31.function(timeout_s=60)
def tiny(x: int) -> int:
    """The work of one item: next to nothing, so the figures are the path's own cost."""
    return x + 1


def e31_map(n: int, workers: int, url: str, tmp: Path) -> dict[str, Any]:
    """`tiny.map(range(n))` on one `e31 up` stack on `url`: wall seconds, uploads, checks."""
    with private_stack(tmp / "e31home", ["--cpu-slots", str(workers)], redis_url=url) as client:
        fn = tiny.using(client)
        assert list(fn.map(range(2 * workers))) == list(range(1, 2 * workers + 1))  # warm-up
        start = time.monotonic()
        values = fn.map(range(n), return_exceptions=True)
        submitted_s = time.monotonic() - start
        got = list(values)
        elapsed = time.monotonic() - start
        array = fn.last_array
        assert array is not None
        items = array.status()["items"]
        once = sum(1 for i in items if i["state"] == "succeeded")
        failed = {i: str(v).splitlines()[0] for i, v in enumerate(got)
                  if isinstance(v, BaseException)}
        uploaded = [s for s in fn.last_sent if s.uploaded]
        return {"s": round(elapsed, 2), "items_per_s": round(n / elapsed, 1),
                "submit_s": round(submitted_s, 2), "values_right_and_in_order":
                all(v == i + 1 for i, v in enumerate(got) if i not in failed),
                "succeeded": once, "failed": failed, "arrays": 1,
                "bundles_uploaded": len(uploaded),
                "bytes_uploaded": sum(s.size_bytes for s in uploaded),
                "bytes_uploaded_per_item": round(sum(s.size_bytes for s in uploaded) / n, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", type=int, default=10_000)
    ap.add_argument("--workers", type=int, default=2)
    args = parse(ap, SMOKE)
    tmp = Path(tempfile.mkdtemp(prefix="e31-bench-"))
    redis_proc, url = start_redis(tmp / "redis")
    try:
        bare = bare_celery(args.items, args.workers, url, tmp, ["bare.noop"])["bare.noop"]
        ours = e31_map(args.items, args.workers, url, tmp)
    finally:
        redis_proc.terminate()
        redis_proc.wait()
    report = {"items": args.items, "workers": args.workers, "bare_celery_noop": bare,
              "e31_map": ours,
              "ratio_e31_map_over_celery_noop": round(ours["items_per_s"] / bare["jobs_per_s"],
                                                      4)}
    save(args, report)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
