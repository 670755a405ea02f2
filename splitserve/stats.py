"""Nearest-rank percentiles, the one definition every latency report here reads (the serving study,
the host-jitter probe, a worker's step trace, kvbench). Standard library only: the workers import it."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentiles(values: list[float], qs: Sequence[float]) -> list[float]:
    """Nearest-rank percentile of `values` at each of `qs` (the smallest value with at least q% of
    the values at or below it), sorting once; NaN for each where there are no values."""
    if not values:
        return [float("nan")] * len(qs)
    ordered = sorted(values)
    # rounded first: 99.9 / 100 * 1000 is 999.0000000000001 in floating point, whose ceiling skips a rank
    ranks = (math.ceil(round(q * len(ordered) / 100, 9)) for q in qs)
    return [ordered[min(len(ordered) - 1, max(0, rank - 1))] for rank in ranks]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile; NaN for no values."""
    return percentiles(values, [q])[0]


def dist(values: list[float]) -> dict[str, float]:
    qs = (50, 90, 99)
    return {f"p{q}": value for q, value in zip(qs, percentiles(values, qs), strict=True)}
