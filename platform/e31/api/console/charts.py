"""Charts drawn on the server as SVG shapes (no script, no library): what a template needs to
lay out a horizontal bar chart."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

BAR_HEIGHT_PX = 22
LABEL_WIDTH_PX = 220
CHART_WIDTH_PX = 640


def bars(values: Sequence[tuple[str, float]]) -> dict[str, Any]:
    """One bar per (label, value), longest first, scaled to the largest; the chart's size."""
    rows = sorted(values, key=lambda v: -v[1])
    top = max((v for _, v in rows), default=0.0) or 1.0
    span = CHART_WIDTH_PX - LABEL_WIDTH_PX - 80
    return {"width": CHART_WIDTH_PX, "height": BAR_HEIGHT_PX * max(len(rows), 1) + 4,
            "label_width": LABEL_WIDTH_PX,
            "bars": [{"label": label, "value": value, "y": i * BAR_HEIGHT_PX + 2,
                      "length": max(1.0, span * value / top), "height": BAR_HEIGHT_PX - 6}
                     for i, (label, value) in enumerate(rows)]}
