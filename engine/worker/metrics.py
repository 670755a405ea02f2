"""Prometheus metrics of one worker, and the small HTTP server for /metrics, /livez and /readyz.

Each worker has its own registry (tests run several workers in one process). Values are updated on
the event loop thread; the HTTP thread only renders them.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from engine.block_pool import BlockPool

_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)


class WorkerMetrics:
    """The worker's series. Owned by the worker's event loop; `render()` may run on any thread."""

    def __init__(self, role: str, worker_id: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge(
            "splitserve_worker_queue_depth", "Requests per stage of this worker", ["stage"], registry=r
        )
        self.kv_blocks = Gauge(
            "splitserve_worker_kv_blocks",
            "KV pool blocks by state (free, cached, held)",
            ["state"],
            registry=r,
        )
        self.step_seconds = Histogram(
            "splitserve_worker_step_seconds",
            "Model step time (forward + sampling) by kind (prefill, decode, mixed)",
            ["kind"],
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        # core leases (engine/worker/core_lease.py)
        self.borrowed_core_steps = Counter(
            "splitserve_worker_borrowed_core_steps",
            "Prompt steps run on borrowed cores beside this worker's own (--borrow-cores)",
            registry=r,
        )
        self.core_claim_seconds = Histogram(
            "splitserve_worker_core_claim_seconds",
            "Wait to take this worker's cores back from a borrower before computing (--lend-cores)",
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        # `transport`: what carried the bytes (kvtransfer.lanes.transport_label: ucx:cma, ucx:tcp,
        # ucx:tcp-lo, tcp, ...), so a silent fallback shows on a dashboard.
        self.transfer_bytes = Counter(
            "splitserve_worker_kv_transfer_bytes",
            "KV bytes moved, by direction and transport",
            ["direction", "transport"],
            registry=r,
        )
        self.transfer_seconds = Histogram(
            "splitserve_worker_kv_transfer_seconds",
            "KV transfer time per request, first send posted to last completion, by direction and transport",
            ["direction", "transport"],
            buckets=_TRANSFER_BUCKETS,
            registry=r,
        )
        self.transfer_chunks = Counter(
            "splitserve_worker_kv_transfer_chunks",
            "KV chunks (KVChunkReady) moved, by direction and transport",
            ["direction", "transport"],
            registry=r,
        )
        self.kv_connections_refused = Counter(
            "splitserve_worker_kv_connections_refused",
            "Connections to the KV transfer listener refused during the hello, by reason",
            ["reason"],
            registry=r,
        )
        self.requests = Counter(
            "splitserve_worker_requests", "Requests that ended here, by outcome", ["outcome"], registry=r
        )
        self.stale_messages = Counter(
            "splitserve_worker_stale_messages",
            "Messages dropped for an older generation or an unknown sender, by kind",
            ["kind"],
            registry=r,
        )
        self.control_dropped = Counter(
            "splitserve_worker_control_dropped",
            "Control messages dropped unread (malformed, unauthenticated, unexpected), by socket and reason",
            ["socket", "reason"],
            registry=r,
        )
        self.kv_cache_huge_page_share = Gauge(
            "splitserve_worker_kv_cache_huge_page_share",
            "Share of the host KV cache on huge pages (kernels.host_memory; under 0.5 the start-up log says what to fix)",
            registry=r,
        )
        self.kv_staging_idle_bytes = Gauge(
            "splitserve_worker_kv_staging_idle_bytes",
            "Staging buffers of packed KV messages kept for reuse (kvtransfer.staging; at most 256 MiB)",
            registry=r,
        )
        self.info = Gauge("splitserve_worker_info", "Constant 1, labelled", ["role", "worker_id"], registry=r)
        self.info.labels(role, worker_id).set(1)

    def observe_pool(self, pool: BlockPool) -> None:
        stats = pool.stats()
        self.kv_blocks.labels("free").set(stats["free"] - stats["cached_free"])
        self.kv_blocks.labels("cached").set(stats["cached_free"])
        self.kv_blocks.labels("held").set(stats["held"])

    def observe_queues(self, depths: Mapping[str, int]) -> None:
        for stage, n in depths.items():
            self.queue_depth.labels(stage).set(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class HealthServer:
    """/metrics (Prometheus text), /livez (the event loop ticked recently), /readyz (`ready()` true).

    Runs in its own daemon thread; `close()` stops it.
    """

    def __init__(
        self,
        host: str,
        port: int,
        metrics: WorkerMetrics,
        ready: Callable[[], bool],
        live_within_s: float = 10.0,
    ) -> None:
        self.metrics = metrics
        self.ready = ready
        self.live_within_s = live_within_s
        self.last_tick = time.monotonic()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._reply(200, server.metrics.render(), CONTENT_TYPE_LATEST)
                elif path == "/livez":
                    alive = time.monotonic() - server.last_tick < server.live_within_s
                    self._reply(200 if alive else 503, b"ok\n" if alive else b"event loop stalled\n")
                elif path == "/readyz":
                    ok = server.ready()
                    self._reply(200 if ok else 503, b"ready\n" if ok else b"not ready\n")
                else:
                    self._reply(404, b"not found\n")

            def _reply(self, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8") -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                return

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="health-http", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"{host!s}:{port}"

    async def keep_alive(self) -> None:
        """Run on the worker's event loop for its whole life: each tick proves to /livez that the loop
        runs (whatever the coordinator does)."""
        while True:
            self.last_tick = time.monotonic()
            await asyncio.sleep(self.live_within_s / 5)  # the tick period /livez checks against

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
