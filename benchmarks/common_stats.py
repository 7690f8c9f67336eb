"""Statistics for the benchmarks: percentiles as numpy's default, and mean/percentile summaries."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]) as numpy's default; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Sequence[float], scale: float = 1.0, qs: Sequence[int] = (50, 90, 99)) -> dict[str, Any]:
    """mean and percentiles of `values` times `scale` (e.g. 1000 for seconds -> ms)."""
    out: dict[str, Any] = {"count": len(values)}
    out["mean"] = sum(values) / len(values) * scale if values else None
    for q in qs:
        p = percentile(values, q)
        out[f"p{q}"] = p * scale if p is not None else None
    return out
