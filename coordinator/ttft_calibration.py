"""How far the router's first-token estimates for long prompts miss, per worker and path, learned from
the first tokens themselves.

A worker that runs `--long-prefill-token-threshold T` serves prompts of at most T tokens first, so
a long prompt's prefill (seconds) gives way to every short prompt that arrives while it runs, and
the decodes those requests add lengthen each of its steps. The router's count (coordinator/router.py)
sees only what is queued when it places the prompt: on the real model at 2 req/s a document placed
on its decode worker took 1.4-2.4x the estimate (docs/performance.md, Session 26). A short prompt goes
before whatever arrives after it, so its estimate has no such blind spot and is left as counted.

A worker incarnation's factor for a path is the median of observed / estimated over its last
`KEEP` long prompts there within `WINDOW_S`, padded with 1 (the count as it is) to `AGREE`
observations: one stall alone (a cold start's first request, a neighbour's burst) moves nothing,
two that agree do, and a factor that kept a worker's long prompts away expires instead of keeping
them away for good. Each observation is clamped to [1/4, 4].

The dispatcher arms a `TtftProbe` when it places a long prompt of a request that has streamed
nothing yet on a worker the router prices by its own fitted cost (`Router.priced_by_own_fit`; a
default cost's miss, 15x on a fresh prefill worker, is not this blind spot), with the estimate as
counted, before the correction; the request table fires it when the first token streams (the held
token's release under `--first-token-from decode`, a wait the estimate includes); a re-placement or
a resume drops it. Kept in `WorkerInfo.long_ttft_ratios`, so a new registration starts afresh.
Event loop only.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field

from coordinator.workers import WorkerInfo
from splitserve.v1 import serving_pb2

KEEP = 5  # observations a worker and path keep
WINDOW_S = 120.0  # older ones no longer count
AGREE = 3  # below this many observations, the count (1) fills the median's rest
MIN_RATIO, MAX_RATIO = 0.25, 4.0


def long_ttft_factor(
    worker: WorkerInfo, path: serving_pb2.PrefillPath.ValueType, now: float | None = None
) -> float:
    """What a long prompt's counted estimate on `worker` by `path` is multiplied by."""
    now = time.monotonic() if now is None else now
    seen = [ratio for at, ratio in worker.long_ttft_ratios.get(path, ()) if now - at <= WINDOW_S]
    return statistics.median(seen + [1.0] * (AGREE - len(seen))) if seen else 1.0


@dataclass(frozen=True, slots=True)
class TtftProbe:
    """What the router counted for one placement of a long prompt, awaiting its first token."""

    worker: WorkerInfo  # the incarnation that prefills it (the decode worker itself on the local path)
    path: serving_pb2.PrefillPath.ValueType
    estimated_ms: float  # as counted, before the correction
    placed_at: float = field(default_factory=time.monotonic)

    def fire(self, first_token_at: float) -> float:
        """Record the first token's observed / estimated (clamped) for the worker; returns it."""
        observed_ms = (first_token_at - self.placed_at) * 1e3
        ratio = min(MAX_RATIO, max(MIN_RATIO, observed_ms / max(self.estimated_ms, 1e-3)))
        self.worker.long_ttft_ratios.setdefault(self.path, deque(maxlen=KEEP)).append((first_token_at, ratio))
        return ratio
