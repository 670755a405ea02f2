"""From request traces to numbers: latency distributions, the latency breakdown, SLOs (absolute, or a
scale of the unloaded latencies per request kind, as DistServe's SLO scale), attainment and goodput.

A request meets its SLO when it finished, its TTFT <= the TTFT SLO and its TPOT <= the TPOT SLO of its
kind. Goodput is the highest swept rate at which attainment >= `target` and at every lower swept rate
too (so one lucky rate past a collapse does not count).
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass
from typing import Any

from splitserve.bench.load import TIMING_FIELDS, RequestTrace
from splitserve.stats import dist

GOODPUT_TARGET = 0.9


@dataclass(frozen=True, slots=True)
class Latency:
    """TTFT and TPOT in milliseconds: an unloaded baseline, or an SLO."""

    ttft_ms: float
    tpot_ms: float


def unloaded(traces: list[RequestTrace]) -> dict[str, Latency]:
    """Per request kind, the median TTFT and TPOT of requests sent alone. ValueError when a probe
    failed: an SLO scale needs every kind's baseline."""
    failed = [t.error or "no tokens" for t in traces if not t.ok]
    if failed:
        raise ValueError(f"unloaded probe failed: {failed[0]}")
    out = {}
    for kind in dict.fromkeys(t.kind for t in traces):
        mine = [t for t in traces if t.kind == kind]
        tpots = [t.tpot_ms for t in mine if t.tpot_ms is not None]
        out[kind] = Latency(statistics.median(t.ttft_ms for t in mine), statistics.median(tpots or [0.0]))
    return out


def scaled(base: dict[str, Latency], scale: float) -> dict[str, Latency]:
    """DistServe's SLO scale: each kind's SLO is `scale` x its unloaded latency."""
    return {k: Latency(v.ttft_ms * scale, v.tpot_ms * scale) for k, v in base.items()}


def attainment(traces: list[RequestTrace], slos: dict[str, Latency]) -> float:
    """The share of `traces` meeting the SLO of their kind (a kind without an SLO is a miss)."""
    return share_within(
        [(t.kind, t.ttft_ms if t.ok else None, t.tpot_ms if t.ok else None) for t in traces], slos
    )


def share_within(outcomes: list[tuple[str, float | None, float | None]], slos: dict[str, Latency]) -> float:
    """The share of `outcomes` (kind, TTFT, TPOT; TTFT None for a request that failed) within the SLO
    of their kind: a failed request and a kind without an SLO are misses, a single-token output has
    no TPOT to miss. NaN for none."""
    if not outcomes:
        return float("nan")
    return sum(
        1
        for kind, ttft, tpot in outcomes
        if kind in slos
        and ttft is not None
        and ttft <= slos[kind].ttft_ms
        and (tpot is None or tpot <= slos[kind].tpot_ms)
    ) / len(outcomes)


def breakdown(trace: RequestTrace) -> dict[str, float]:
    """The server's timings of one finished request plus `other_ms`: first token time not spent
    queued, prefilling or (`kv_transfer_in_ttft`) moving the KV: routing, delivery, and the wait for
    the decode worker's step boundary. The KV transfer starts once the first token is sampled, so
    it lies in TTFT when that token waited for the decode worker (the coordinator's
    --first-token-from decode: TTFT = queue + prefill + kv transfer + other), else in decode (it
    delays the second token; TTFT = queue + prefill + other). A resumed request has no `other_ms`:
    its queue and prefill sum every run, the later ones after its first token (that is how `other`
    once came out at -48 ms). Empty for a request that never finished."""
    if not trace.timings:
        return {}
    t = trace.timings
    parts = {name: t[name] for name in TIMING_FIELDS}
    if trace.resumes == 0:
        kv = t["kv_transfer_ms"] if trace.kv_transfer_in_ttft else 0.0
        parts["other_ms"] = t["first_token_ms"] - t["queue_ms"] - t["prefill_ms"] - kv
    return parts


def summarize(traces: list[RequestTrace], duration: float, slos: dict[str, Latency]) -> dict[str, Any]:
    """One rate's row: counts, throughput, TTFT/TPOT/ITL distributions, mean breakdown, attainment."""
    ok = [t for t in traces if t.ok]
    parts = [b for b in (breakdown(t) for t in ok) if b]
    keys = dict.fromkeys(k for b in parts for k in b)  # other_ms: over the requests never resumed
    mean_breakdown = {k: statistics.fmean(b[k] for b in parts if k in b) for k in keys}
    return {
        "num_requests": len(traces),
        "completed": len(ok),
        "duration_s": duration,
        "output_tok_s": sum(len(t.token_times) for t in ok) / duration if duration > 0 else 0.0,
        "ttft_ms": dist([t.ttft_ms for t in ok]),
        "tpot_ms": dist([x for t in ok if (x := t.tpot_ms) is not None]),
        "itl_ms": dist([x for t in ok for x in t.itls_ms]),
        # each request's first gap (token 1 -> 2: a remote request's hop, P's token then D's first
        # step), and every gap after it: where the ITL tail comes from
        "first_itl_ms": dist([gap for t in ok if (gap := t.first_gap_ms) is not None]),
        "later_itl_ms": dist([x for t in ok for x in t.itls_ms[1:]]),
        "breakdown_ms": mean_breakdown,
        "attainment": attainment(traces, slos),
        "paths": dict(Counter(t.path for t in ok if t.path)),  # the router's prefill decisions
        "resumed": sum(1 for t in ok if t.resumes),
        "errors": dict(Counter(t.error for t in traces if t.error)),
    }


def goodput(points: list[tuple[float, float]], target: float = GOODPUT_TARGET) -> float:
    """The highest rate of (rate, attainment) points that meets `target` with every lower rate
    meeting it too; 0.0 when the lowest rate already misses. Rates <= 0 (bursts) are ignored."""
    best = 0.0
    for rate, share in sorted(p for p in points if p[0] > 0):
        if not share >= target:
            break
        best = rate
    return best
