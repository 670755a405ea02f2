"""The coordinator process's parts, wired together: gRPC and HTTP servers, control plane, metrics, health.

`Coordinator(config).start()` binds everything (port 0 = OS-chosen; see `ready_info`), `drain()` stops
admitting and waits for in-flight requests (bounded), `stop()` closes. Tests run it in-process;
`coordinator.main` runs it as the `splitserve coordinator` process.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from dataclasses import dataclass
from typing import Any

import grpc
import structlog
import zmq.asyncio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from coordinator.admission import Admission
from coordinator.chat import TokenizerThread
from coordinator.control_loop import ControlPlane, Outbox
from coordinator.dispatch import Dispatcher
from coordinator.errors import unavailable
from coordinator.http.routes import OpenAIRoutes
from coordinator.http.server import HttpServer
from coordinator.metrics import CoordinatorMetrics, serve_metrics
from coordinator.request_table import EndEvent, RequestTable
from coordinator.router import Router
from coordinator.served_model import ServedModel, load_served_model
from coordinator.server import AdminServicer, InferenceServicer, ModelServicer
from coordinator.workers import WorkerRegistry
from splitserve.control import ControlSocket
from splitserve.v1 import control_pb2, serving_pb2, serving_pb2_grpc

log = structlog.get_logger(__name__)

SERVICE_NAMES = tuple(
    serving_pb2.DESCRIPTOR.services_by_name[n].full_name
    for n in ("InferenceService", "ModelService", "AdminService")
)
# gRPC's own receive limit sits above the request byte limit, so only grossly oversized calls hit it
_GRPC_RECEIVE_FACTOR = 4


@dataclass(slots=True)
class CoordinatorConfig:
    """Everything `splitserve coordinator` takes on its command line (see coordinator.main)."""

    model: str
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 50051
    control_host: str = "127.0.0.1"
    control_port: int = 5555
    metrics_port: int = 9100
    http_port: int = 0  # the CLI's --http-port defaults to 8000; in-process coordinators take a free port
    api_keys: tuple[str, ...] = ()
    max_queue: int = 256
    max_request_bytes: int = 1 << 20
    heartbeat_interval_ms: int = 500
    heartbeat_timeout_ms: int = 3000
    drain_timeout: float = 30.0


class Coordinator:
    """One coordinator. Created, started, drained and stopped by its owner (main or a test)."""

    def __init__(self, config: CoordinatorConfig, model: ServedModel | None = None) -> None:
        self.config = config
        self.model = model
        self.incarnation = secrets.randbits(63)
        self.grpc_address = self.control_address = self.metrics_address = self.http_address = ""
        self._tasks: set[asyncio.Task[Any]] = set()
        self._health_lock = asyncio.Lock()

    async def start(self) -> None:
        cfg = self.config
        if self.model is None:
            self.model = await asyncio.to_thread(load_served_model, cfg.model, cfg.served_model_name)
        self.metrics = CoordinatorMetrics()
        self.table = RequestTable(self.metrics)
        self.registry = WorkerRegistry(self.model, cfg.heartbeat_timeout_ms / 1e3)
        self.tokenizer = TokenizerThread(self.model.tokenizer)
        self.admission = Admission(
            self.model, self.tokenizer, api_keys=cfg.api_keys, max_request_bytes=cfg.max_request_bytes
        )
        self._zmq = zmq.asyncio.Context()
        self.socket = ControlSocket.router(self._zmq, f"tcp://{cfg.control_host}:{cfg.control_port}")
        self.control_address = self.socket.address
        outbox = Outbox(self.socket)
        self.dispatcher = Dispatcher(
            self.table,
            self.registry,
            Router(self.registry),
            self.metrics,
            outbox.post,
            max_queue=cfg.max_queue,
            retry_after_s=max(cfg.heartbeat_interval_ms / 1e3, 0.1),
        )
        self.plane = ControlPlane(
            self.socket,
            outbox,
            self.registry,
            self.table,
            self.dispatcher,
            self.metrics,
            incarnation=self.incarnation,
            heartbeat_interval_ms=cfg.heartbeat_interval_ms,
            heartbeat_timeout_ms=cfg.heartbeat_timeout_ms,
            on_membership=self._membership_changed,
        )
        self.health = health.aio.HealthServicer()
        await self._sync_health()
        limit = cfg.max_request_bytes * _GRPC_RECEIVE_FACTOR
        self.server = grpc.aio.server(options=[("grpc.max_receive_message_length", limit)])
        serving_pb2_grpc.add_InferenceServiceServicer_to_server(
            InferenceServicer(self.admission, self.dispatcher, self.metrics), self.server
        )
        serving_pb2_grpc.add_ModelServiceServicer_to_server(
            ModelServicer(self.admission, self.registry, self.metrics), self.server
        )
        serving_pb2_grpc.add_AdminServiceServicer_to_server(
            AdminServicer(self.admission, self.plane, self.metrics), self.server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (
                *SERVICE_NAMES,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            self.server,
        )
        port = self.server.add_insecure_port(f"{cfg.host}:{cfg.port}")
        await self.server.start()
        self.grpc_address = f"{cfg.host}:{port}"
        routes = OpenAIRoutes(self.admission, self.dispatcher, self.metrics)
        # TLS seam: the SSLContext of the coordinator's TLS settings goes here (None = plaintext)
        self.http = HttpServer(routes.app, cfg.host, cfg.http_port, ssl_context=None)
        self.http_address = await self.http.start()
        self._metrics_server, self.metrics_address = serve_metrics(self.metrics, cfg.host, cfg.metrics_port)
        self.plane_task = asyncio.create_task(self.plane.run(), name="control-plane")
        log.info("coordinator started", model=self.model.name, **self.ready_info())

    def ready_info(self) -> dict[str, str]:
        return {
            "role": "coordinator",
            "grpc_address": self.grpc_address,
            "control_address": self.control_address,
            "metrics_address": self.metrics_address,
            "http_address": self.http_address,
        }

    def _membership_changed(self) -> None:
        task = asyncio.get_running_loop().create_task(self._sync_health())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _sync_health(self) -> None:
        """SERVING while a prefill + decode pair (or a colocated worker) of the model is READY."""
        async with self._health_lock:
            serving = self.registry.can_serve() and not self.dispatcher.draining
            status = (
                health_pb2.HealthCheckResponse.SERVING
                if serving
                else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            for service in ("", *SERVICE_NAMES):
                await self.health.set(service, status)

    async def drain(self, timeout_s: float) -> None:
        """Stop admitting; let in-flight requests finish for up to `timeout_s`, then fail the rest."""
        self.dispatcher.draining = True
        await self.health.enter_graceful_shutdown()
        try:
            await asyncio.wait_for(self.table.wait_empty(), timeout_s)
        except TimeoutError:
            leftover = list(self.table.records())
            log.warning("drain timed out; aborting in-flight requests", requests=len(leftover))
            for record in leftover:
                error = unavailable("SHUTTING_DOWN", "the server shut down before the request finished")
                self.dispatcher.cancel(record, control_pb2.ABORT_REASON_SHUTDOWN, EndEvent(error))
        with contextlib.suppress(TimeoutError):  # the Aborts leave before the socket closes
            await asyncio.wait_for(self.plane.outbox.flush(), 1.0)

    async def stop(self) -> None:
        await self.http.stop()
        await self.server.stop(grace=1.0)
        self.plane_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.plane_task
        self.socket.close()
        self._zmq.term()
        self._metrics_server.shutdown()
        self.tokenizer.close()
