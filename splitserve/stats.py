"""Nearest-rank percentiles, the one definition every latency report here reads (the serving study,
the host-jitter probe, a worker's step trace). Standard library only: the workers import it."""

from __future__ import annotations

import math


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile: the smallest value with at least `q`% of the values at or below it;
    NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    # rounded first: 99.9 / 100 * 1000 is 999.0000000000001 in floating point, whose ceiling skips a rank
    rank = math.ceil(round(q * len(ordered) / 100, 9))
    return ordered[min(len(ordered) - 1, max(0, rank - 1))]


def dist(values: list[float]) -> dict[str, float]:
    return {f"p{q}": percentile(values, q) for q in (50, 90, 99)}
