"""The coordinator's Prometheus metrics, on a registry of its own (several coordinators may share a process
in tests). Served on --metrics-port at /metrics by `serve_metrics`."""

from __future__ import annotations

import contextlib
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# latency buckets in seconds: sub-millisecond steps for ITL on small models up to long TTFTs
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class CoordinatorMetrics:
    """Created once per coordinator; each field is updated by the module that owns that number."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge(
            "splitserve_coordinator_queue_depth", "Requests waiting in the admission queue.", registry=r
        )
        self.active_requests = Gauge(
            "splitserve_coordinator_active_requests", "Requests admitted and not yet ended.", registry=r
        )
        self.requests = Counter(
            "splitserve_coordinator_requests", "Requests ended, by outcome.", ["outcome"], registry=r
        )
        self.rejections = Counter(
            "splitserve_coordinator_rejections", "Calls rejected, by ErrorReason.", ["reason"], registry=r
        )
        self.late_outputs_dropped = Counter(
            "splitserve_coordinator_late_outputs_dropped",
            "Worker outputs dropped: unknown or ended request, or an older generation.",
            registry=r,
        )
        self.resumes = Counter(
            "splitserve_coordinator_resumes",
            "Requests re-placed through prefill (preemption, lost worker, lease), by cause.",
            ["cause"],
            registry=r,
        )
        self.placements = Counter(
            "splitserve_coordinator_placements",
            "Placements (first and resumed), by decision: remote (prefill worker, KV shipped), local "
            "(the decode worker prefills itself) or colocated.",
            ["decision"],
            registry=r,
        )
        self.ttft = Histogram(
            "splitserve_coordinator_ttft_seconds",
            "Arrival to first token sent.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.long_prompt_ttft_ratio = Histogram(
            "splitserve_coordinator_long_prompt_ttft_ratio",
            "Long prompts (over the worker's --long-prefill-token-threshold): observed / estimated time "
            "from placement to first token, by decision (the router corrects its estimates by it).",
            ["decision"],
            buckets=(0.25, 0.5, 0.75, 0.9, 1.1, 1.25, 1.5, 2.0, 3.0, 4.0),
            registry=r,
        )
        self.tpot = Histogram(
            "splitserve_coordinator_tpot_seconds",
            "Per request: (last token - first token) / (output tokens - 1).",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "splitserve_coordinator_itl_seconds",
            "Gap between consecutive streamed deltas.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.control_dropped = Counter(
            "splitserve_coordinator_control_dropped",
            "Control messages dropped unread: malformed, unauthenticated or unexpected, by reason.",
            ["reason"],
            registry=r,
        )
        self.worker_kv_blocks = Gauge(
            "splitserve_worker_kv_blocks",
            "KV blocks per worker from its last report, by state (free, cached, held).",
            ["worker_id", "role", "state"],
            registry=r,
        )

    def set_worker_pool(self, worker_id: str, role: str, pool: Any) -> None:
        """Record a KvPoolState report."""
        for state in ("free", "cached", "held"):
            self.worker_kv_blocks.labels(worker_id, role, state).set(getattr(pool, f"{state}_blocks"))

    def forget_worker(self, worker_id: str, role: str) -> None:
        for state in ("free", "cached", "held"):
            with contextlib.suppress(KeyError):
                self.worker_kv_blocks.remove(worker_id, role, state)


def serve_metrics(metrics: CoordinatorMetrics, host: str, port: int) -> tuple[Any, str]:
    """Start the /metrics HTTP server on a daemon thread; returns (server, "host:port")."""
    from prometheus_client import start_http_server

    server, _thread = start_http_server(port, addr=host, registry=metrics.registry)
    return server, f"{host}:{server.server_address[1]}"
