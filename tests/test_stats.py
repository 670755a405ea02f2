"""splitserve/stats.py: the nearest-rank percentile every latency report reads."""

from __future__ import annotations

import math

import pytest

from kvtransfer.bench.bench_loops import percentiles_us
from splitserve.stats import dist, percentile


def test_nearest_rank_at_the_edges_and_where_floating_point_overshoots() -> None:
    values = [float(v) for v in range(1000, 0, -1)]  # any order
    assert [percentile(values, q) for q in (0, 50, 90, 99, 99.9, 100)] == [1, 500, 900, 990, 999, 1000]
    ten_thousand = [float(v) for v in range(1, 10_001)]
    assert percentile(ten_thousand, 99.9) == 9990  # 99.9 / 100 * 10000 is 9990.000000000002
    assert percentile([7.0], 99) == 7 and math.isnan(percentile([], 50))
    assert dist([1.0, 2.0, 3.0, 4.0]) == {"p50": 2, "p90": 4, "p99": 4}


def test_kvbench_latencies_rank_as_every_other_report() -> None:
    seconds = [v * 1e-6 for v in range(1, 1001)]
    assert percentiles_us(seconds) == pytest.approx({"p50_us": 500.0, "p99_us": 990.0, "p999_us": 999.0})
