"""Charts drawn on the server as SVG shapes (no script, no library): what a template needs to
lay out a horizontal bar chart."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

BAR_HEIGHT_PX = 22
LABEL_WIDTH_PX = 220
CHART_WIDTH_PX = 640


def bars(values: Sequence[tuple[str, float]], *, longest_first: bool = True) -> dict[str, Any]:
    """One bar per (label, value), longest first (or in the order given), scaled to the
    largest; the chart's size."""
    rows = sorted(values, key=lambda v: -v[1]) if longest_first else list(values)
    top = max((v for _, v in rows), default=0.0) or 1.0
    span = CHART_WIDTH_PX - LABEL_WIDTH_PX - 80
    return {"width": CHART_WIDTH_PX, "height": BAR_HEIGHT_PX * max(len(rows), 1) + 4,
            "label_width": LABEL_WIDTH_PX,
            "bars": [{"label": label, "value": value, "y": i * BAR_HEIGHT_PX + 2,
                      "length": max(1.0, span * value / top), "height": BAR_HEIGHT_PX - 6}
                     for i, (label, value) in enumerate(rows)]}


SERIES_WIDTH_PX = 640
SERIES_HEIGHT_PX = 160
SERIES_PAD_PX = 44


def gpu_lines(points: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """A job's GPU utilisation and memory used (as % of its GPUs' memory) over its run, as
    two SVG polylines on a 0-100% scale; None with fewer than two points."""
    if len(points) < 2:
        return None
    t0, t1 = points[0]["t"], points[-1]["t"]
    span_s = max(t1 - t0, 1e-9)
    inner_w = SERIES_WIDTH_PX - 2 * SERIES_PAD_PX
    inner_h = SERIES_HEIGHT_PX - 2 * SERIES_PAD_PX

    def xy(t: float, pct: float) -> str:
        x = SERIES_PAD_PX + inner_w * (t - t0) / span_s
        y = SERIES_PAD_PX + inner_h * (1 - min(max(pct, 0.0), 100.0) / 100)
        return f"{x:.1f},{y:.1f}"

    util = [xy(p["t"], p["util_pct"]) for p in points if p.get("util_pct") is not None]
    mem = [xy(p["t"], 100 * p["mem_used_bytes"] / p["mem_total_bytes"]) for p in points
           if p.get("mem_used_bytes") is not None and p.get("mem_total_bytes")]
    peak = max((p["mem_used_bytes"] for p in points if p.get("mem_used_bytes") is not None),
               default=None)
    return {"width": SERIES_WIDTH_PX, "height": SERIES_HEIGHT_PX, "pad": SERIES_PAD_PX,
            "bottom": SERIES_HEIGHT_PX - SERIES_PAD_PX, "right": SERIES_WIDTH_PX - SERIES_PAD_PX,
            "util": " ".join(util), "mem": " ".join(mem), "span_s": span_s,
            "points": len(points), "mem_peak_bytes": peak,
            "mem_total_bytes": points[-1].get("mem_total_bytes")}
