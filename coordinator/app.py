"""The coordinator process's parts, wired together: gRPC and HTTP servers, control plane, metrics, health.

`Coordinator(config).start()` binds everything (port 0 = OS-chosen; see `ready_info`), `drain()` stops
admitting and waits for in-flight requests (bounded), `stop()` closes. Tests run it in-process;
`coordinator.main` runs it as the `splitserve coordinator` process.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from typing import Any

import grpc
import structlog
import zmq.asyncio
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection

from coordinator.admission import Admission
from coordinator.auth import Authenticator, KeyRing
from coordinator.chat import TokenizerThread
from coordinator.config import CoordinatorConfig
from coordinator.control_loop import CoordinatorControl, Outbox
from coordinator.dispatch import Dispatcher
from coordinator.errors import unavailable
from coordinator.http.routes import OpenAIRoutes
from coordinator.http.server import HttpServer
from coordinator.metrics import CoordinatorMetrics, serve_metrics
from coordinator.request_table import EndEvent, RequestTable
from coordinator.router import Router
from coordinator.rpc_handlers import add_service
from coordinator.served_model import ServedModel, load_served_model
from coordinator.server import AdminServicer, InferenceServicer, ModelServicer
from coordinator.tls import ServerTls
from coordinator.workers import WorkerRegistry
from splitserve.control import ControlSocket, CurveKeys
from splitserve.control_auth import (
    INSECURE_WARNING,
    AuthorizedKeys,
    ControlKeyError,
    ZapHandler,
    load_keys,
)
from splitserve.v1 import control_pb2, serving_pb2

log = structlog.get_logger(__name__)

SERVICE_NAMES = tuple(
    serving_pb2.DESCRIPTOR.services_by_name[n].full_name
    for n in ("InferenceService", "ModelService", "AdminService")
)
# gRPC's own receive limit sits above the request byte limit, so only grossly oversized calls hit it
_GRPC_RECEIVE_FACTOR = 4


class Coordinator:
    """One coordinator. Created, started, drained and stopped by its owner (main or a test)."""

    def __init__(self, config: CoordinatorConfig, model: ServedModel | None = None) -> None:
        self.config = config
        self.model = model
        self.incarnation = secrets.randbits(63)
        self.grpc_address = self.control_address = self.metrics_address = self.admin_address = ""
        self.http_address = ""
        self.health_address = ""
        self.tls = config.tls()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._health_lock = asyncio.Lock()
        self.failed = False  # the control plane died: never SERVING again

    async def start(self) -> None:
        cfg = self.config
        if self.model is None:
            self.model = await asyncio.to_thread(load_served_model, cfg.model, cfg.served_model_name)
        self.metrics = CoordinatorMetrics()
        self.table = RequestTable(self.metrics, hold_first_token=cfg.routing.first_token_from == "decode")
        self.registry = WorkerRegistry(self.model, cfg.heartbeat_timeout_ms / 1e3)
        self.tokenizer = TokenizerThread(self.model.tokenizer, cfg.templates)
        self.auth = Authenticator(KeyRing.parse(cfg.api_keys), KeyRing.parse(cfg.admin_keys))
        self.admission = Admission(
            self.model, self.tokenizer, auth=self.auth, max_request_bytes=cfg.max_request_bytes
        )
        keys, authorized = self._control_keys()
        self._zmq = zmq.asyncio.Context()
        self._auth = None if authorized is None else ZapHandler(self._zmq, authorized.__contains__).start()
        self.socket = ControlSocket.router(
            self._zmq,
            f"tcp://{cfg.control_host}:{cfg.control_port}",
            keys=keys,
            on_drop=lambda reason: self.metrics.control_dropped.labels(reason).inc(),
        )
        self.control_address = self.socket.address
        outbox = Outbox(self.socket)
        self.dispatcher = Dispatcher(
            self.table,
            self.registry,
            Router(self.registry, cfg.routing),
            self.metrics,
            outbox.post,
            max_queue=cfg.max_queue,
            retry_after_s=max(cfg.heartbeat_interval_ms / 1e3, 0.1),
        )
        self.plane = CoordinatorControl(
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
            authorized=authorized,
        )
        self.health = health.aio.HealthServicer()
        await self._sync_health()
        inference = InferenceServicer(self.admission, self.dispatcher, self.metrics)
        models = ModelServicer(self.admission, self.registry, self.metrics)
        admin = AdminServicer(self.auth, self.plane, self.metrics)
        main: list[tuple[str, Any]] = [("InferenceService", inference), ("ModelService", models)]
        if cfg.admin_port is None:
            main.append(("AdminService", admin))
        self.server, self.grpc_address = await self._listen(main, cfg.host, cfg.port, self.tls)
        self.admin_server = self.health_server = None
        if cfg.admin_port is not None:
            self.admin_server, self.admin_address = await self._listen(
                [("AdminService", admin)], cfg.admin_host, cfg.admin_port, self.tls
            )
        if cfg.health_port is not None:  # health only: no key, no data, so plaintext is acceptable
            self.health_server, self.health_address = await self._listen(
                [], cfg.health_host, cfg.health_port, None
            )
        routes = OpenAIRoutes(self.admission, self.dispatcher, self.metrics, self.serving)
        # the same TLS files and client-certificate rule as gRPC (one way in for both doors)
        self.http = HttpServer(
            routes.app,
            cfg.host,
            cfg.http_port,
            ssl_context=None if self.tls is None else self.tls.ssl_context(),
        )
        self.http_address = await self.http.start()
        self._metrics_server, self.metrics_address = serve_metrics(self.metrics, cfg.host, cfg.metrics_port)
        self.plane_task = asyncio.create_task(self.plane.run(), name="control-plane")
        self.plane_task.add_done_callback(self._plane_ended)
        log.info("coordinator started", model=self.model.name, **self.ready_info())

    def _control_keys(self) -> tuple[CurveKeys | None, AuthorizedKeys | None]:
        """(own keypair, authorized key -> role), or (None, None) under --insecure-control-plane."""
        cfg = self.config
        if cfg.insecure_control_plane:
            log.warning(INSECURE_WARNING)
            return None, None
        if not cfg.control_key or not cfg.control_authorized_keys:
            raise ControlKeyError(
                "the control plane is authenticated by default: give --control-key (this coordinator's "
                ".key_secret) and --control-authorized-keys (a dir of worker public keys), or "
                "--insecure-control-plane"
            )
        return load_keys(cfg.control_key), AuthorizedKeys(cfg.control_authorized_keys)

    def _plane_ended(self, task: asyncio.Task[None]) -> None:
        """Supervision: a control plane that ends (not cancelled by `stop`) takes health down at once;
        the owner (coordinator.main) sees `plane_task` done and exits non-zero."""
        if task.cancelled():
            return
        log.error("control plane died; health NOT_SERVING", error=repr(task.exception()))
        self.failed = True
        self._membership_changed()

    async def _listen(
        self, services: list[tuple[str, Any]], host: str, port: int, tls: ServerTls | None
    ) -> tuple[grpc.aio.Server, str]:
        """A started gRPC server with `services` (serving.proto name, servicer), health and reflection.

        Health is open (probes carry no key). Reflection describes only the public schema of this
        listener's services: no worker address, no request, no key."""
        limit = self.config.max_request_bytes * _GRPC_RECEIVE_FACTOR
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", limit)])
        health_service = health_pb2.DESCRIPTOR.services_by_name["Health"]
        add_service(server, health_service, health_pb2, self.health, self.metrics)
        names = [health_service.full_name, reflection.SERVICE_NAME]
        for name, servicer in services:
            service = serving_pb2.DESCRIPTOR.services_by_name[name]
            add_service(server, service, serving_pb2, servicer, self.metrics)
            names.append(service.full_name)
        reflection.enable_server_reflection(names, server)
        address = f"{host}:{port}"
        bound = (
            server.add_insecure_port(address)
            if tls is None
            else server.add_secure_port(address, tls.credentials())
        )
        await server.start()
        return server, f"{host}:{bound}"

    def ready_info(self) -> dict[str, str]:
        info = {
            "role": "coordinator",
            "grpc_address": self.grpc_address,
            "control_address": self.control_address,
            "metrics_address": self.metrics_address,
            "http_address": self.http_address,
        }
        if self.admin_address:
            info["admin_address"] = self.admin_address
        if self.health_address:
            info["health_address"] = self.health_address
        return info

    def _membership_changed(self) -> None:
        task = asyncio.get_running_loop().create_task(self._sync_health())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def serving(self) -> bool:
        """The health rule of both doors: a ready prefill + decode pair (or a colocated worker), not
        draining, and the control plane alive."""
        return self.registry.can_serve() and not self.dispatcher.draining and not self.failed

    async def _sync_health(self) -> None:
        """SERVING while a prefill + decode pair (or a colocated worker) of the model is READY."""
        async with self._health_lock:
            status = (
                health_pb2.HealthCheckResponse.SERVING
                if self.serving()
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
        for server in (self.admin_server, self.health_server):
            if server is not None:
                await server.stop(grace=1.0)
        self.plane_task.cancel()
        await asyncio.gather(self.plane_task, return_exceptions=True)
        self.socket.close()
        if self._auth is not None:
            self._auth.stop()
        self._zmq.term()
        self._metrics_server.shutdown()
        self.tokenizer.close()
