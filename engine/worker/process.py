"""One worker: its parts started in order, its drain, and the process entry point `run_worker`.

Start order (each step needs the one before): engine (KV pool + cache tensor) → transfer listener →
HTTP (/metrics /livez /readyz) → control sockets → Register/RegisterAck → reader tasks + heartbeats +
step loop → readiness line. Stop (SIGTERM, SIGINT or Shutdown): stop taking work, heartbeat DRAINING,
wait for in-flight requests (bounded by --drain-timeout or Shutdown.grace_ms), abort the rest,
Deregister, close in reverse order, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
from typing import Any

import structlog

from engine.llm_engine import LLMEngine
from engine.loader import LoadedModel
from engine.worker.core_lease import CoreLeases
from engine.worker.metrics import HealthServer, WorkerMetrics
from engine.worker.role import WorkerParts, WorkerRole
from engine.worker.runtime import RegistrationError, WorkerControl
from engine.worker.settings import WorkerSettings, settings_from_args
from engine.worker.step_trace import StepTrace
from engine.worker.stepper import StepLoop
from engine.worker.transfer import TransferPlane, kv_layout_proto
from kernels import cpu_ext
from kvtransfer import staging
from splitserve.control_auth import ControlKeyError
from splitserve.heap import freeze_heap
from splitserve.v1 import control_pb2, serving_pb2

log = structlog.get_logger(__name__)

READY_PREFIX = "SPLITSERVE_READY "


class WorkerFailed(RuntimeError):
    """A part the worker cannot serve without died; the process exits non-zero."""


class Worker:
    """A prefill, decode or colocated worker in this process. `start()`, then `serve()` until stopped.

    `role_class` (handed in by `prefill/main.py` or `decode/main.py`; the runtime never imports the
    roles) sets the engine's policy through `engine_config` and handles the request messages. Tests
    build several in one process (each has its own engine, sockets, registry and threads). `leases`
    (`core_leases(settings)`, built by the process entry before the model loads) pass to the step
    loop, which owns and closes them. `step_trace` (`--step-trace-dir`, opened by the process entry
    before the model loads) is written by the step loop and closed by `close()`.
    """

    def __init__(
        self,
        settings: WorkerSettings,
        loaded: LoadedModel,
        role_class: type[WorkerRole],
        leases: CoreLeases | None = None,
        step_trace: StepTrace | None = None,
    ) -> None:
        self.settings = settings
        self.role_class = role_class
        self.engine = LLMEngine(loaded, role_class.engine_config(settings.engine))
        self.metrics = WorkerMetrics(settings.role, settings.worker_id)
        if (share := self.engine.runner.kv_cache_huge_page_share) is not None:
            self.metrics.kv_cache_huge_page_share.set(share)
        staging_pool = staging.pool_for(self.engine.runner.kv_cache)
        self.metrics.kv_staging_idle_bytes.set_function(lambda: staging_pool.idle_bytes)
        self.step_trace = step_trace
        self.stepper = StepLoop(
            self.engine, self.metrics, leases, net_of_waits=settings.idle_priority, trace=self.step_trace
        )
        self.transfer: TransferPlane | None = None
        self.health: HealthServer | None = None
        self.control: WorkerControl | None = None
        self.role: WorkerRole | None = None
        self._step_task: asyncio.Task[None] | None = None
        self._live_task: asyncio.Task[None] | None = None
        self._closed = False

    async def start(self) -> dict[str, Any]:
        """Bring every part up and register; returns the readiness line's fields."""
        s = self.settings
        if s.role != "colocated":
            self.transfer = await TransferPlane.listen(s, self.engine, self.metrics)
            self.transfer.on_release = self.stepper.wake  # freed blocks may let waiting work run
        self.health = HealthServer(s.advertise_host, s.metrics_port, self.metrics, self._ready)
        self._live_task = asyncio.create_task(self.health.keep_alive(), name="livez")
        self.control = WorkerControl(
            s,
            self.engine.pool,
            kv_layout_proto(self.engine),
            self.engine.loaded.identity,
            self.engine.max_model_len,
            self.transfer.address if self.transfer else "",
            self.metrics,
            self.transfer.transport.key if self.transfer else b"",
        )
        if self.transfer is not None:
            self.control.on_peers = self._preconnect
        await self.control.register()
        self.role = self._make_role(self.control)
        self.control.start(self.role)
        self._step_task = asyncio.create_task(self.stepper.run(), name="engine-steps")
        return {
            "role": s.role,
            "worker_id": s.worker_id,
            "control_address": self.control.control_address,
            "metrics_address": self.health.address,
            "transfer_address": self.transfer.address if self.transfer else "",
        }

    def _make_role(self, control: WorkerControl) -> WorkerRole:
        parts = WorkerParts(self.settings, self.engine, self.stepper, control, self.metrics, self.transfer)
        return self.role_class(parts)

    def _preconnect(self, peers: list[control_pb2.Peer]) -> None:
        assert self.transfer is not None
        prefill = serving_pb2.WORKER_ROLE_PREFILL
        self.transfer.preconnect(p.endpoint for p in peers if p.role == prefill)

    def _ready(self) -> bool:
        return self.control is not None and self.control.ready

    async def serve(self) -> None:
        """Run until a stop is requested, then drain and close. Raises `WorkerFailed` (after failing
        its requests and deregistering) when the step loop or a supervised control task dies."""
        assert self.control is not None and self._step_task is not None
        stop = asyncio.create_task(self.control.stop_requested.wait())
        failed = asyncio.create_task(self.control.failed.wait())
        # idle wait for the end of the worker's life
        await asyncio.wait({stop, failed, self._step_task}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        failed.cancel()
        if self._step_task.done() and self._step_task.exception() is not None:
            self.control.failure = (
                self.control.failure or f"engine-steps ended: {self._step_task.exception()!r}"
            )
        if self.control.failure:
            await self._fail(self.control.failure)
        await self.drain()

    async def _fail(self, why: str) -> None:
        c, role = self.control, self.role
        assert c is not None and role is not None
        role.accepting = False
        with contextlib.suppress(Exception):  # best effort: the part that died may be needed here
            await role.abort_all(control_pb2.ABORT_REASON_WORKER_ERROR, why)
            await c.deregister(f"failed: {why}")
        await self.close()
        raise WorkerFailed(why)

    async def drain(self) -> None:
        c, role = self.control, self.role
        assert c is not None and role is not None
        role.accepting = False
        c.draining = True
        await c.send_heartbeat()
        if c.stop_drain:
            log.info("draining", in_flight=len(role.records), grace_s=c.stop_grace_s)
            try:  # bounded wait: in-flight requests finish, up to the grace period
                await asyncio.wait_for(role.idle.wait(), c.stop_grace_s)
            except TimeoutError:
                log.warning("drain timed out", in_flight=len(role.records))
        await role.abort_all(control_pb2.ABORT_REASON_SHUTDOWN, "worker shutting down")
        await c.deregister("shutdown")
        await self.close()

    async def close(self) -> None:
        """Stop everything this worker started (safe after a failed start, and idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.stepper.stop()
        if self._step_task is not None:
            await asyncio.gather(self._step_task, return_exceptions=True)
        if self.step_trace is not None:
            self.step_trace.close()
        if self.control is not None:
            await self.control.close()
        if self.transfer is not None:
            await self.transfer.close()
        if self._live_task is not None:
            self._live_task.cancel()
        if self.health is not None:
            self.health.close()


def run_worker(args: argparse.Namespace, role: str, role_class: type[WorkerRole]) -> int:
    """The body of `splitserve prefill|decode`: load, start, print the readiness line, serve, drain.
    `role` is the registered role name, `role_class` the role that serves it."""
    from splitserve.logs import configure_logging

    try:
        settings = settings_from_args(args, role)
    except ValueError as exc:  # flags argparse takes one by one but the engine refuses together
        sys.stderr.write(f"splitserve {role}: error: {exc}\n")
        return 2
    configure_logging(role=role, worker_id=settings.worker_id)
    if settings.idle_priority:  # before any thread starts: they inherit it
        from splitserve.placement import run_at_idle_priority

        run_at_idle_priority()
        log.info("cpu priority", policy="SCHED_IDLE")
    return asyncio.run(_main(settings, role_class))


async def _main(settings: WorkerSettings, role_class: type[WorkerRole]) -> int:
    from engine.loader import load_model
    from engine.model_dir import resolve_model_dir
    from splitserve.progress import announce

    try:
        leases = core_leases(settings)  # before the model: a bad lease setting fails in a second
    except ValueError as exc:
        log.error("bad core lease settings", error=str(exc))
        return 2
    try:  # before the model too: a directory this process cannot write fails in a second
        step_trace = (
            StepTrace(settings.step_trace_dir, settings.worker_id) if settings.step_trace_dir else None
        )
    except OSError as exc:
        log.error("cannot write the step trace", directory=settings.step_trace_dir, error=str(exc))
        return 2
    cfg = settings.engine
    announce("preparing the model")
    model_dir = await asyncio.to_thread(resolve_model_dir, settings.model, announce)
    announce(f"loading {model_dir.name}")
    loaded = await asyncio.to_thread(load_model, model_dir, dtype=cfg.torch_dtype, device=cfg.device)
    announce("allocating the KV cache, loading kernels")  # the engine's runner loads the CPU kernels
    worker = Worker(settings, loaded, role_class, leases, step_trace)
    announce("registering with the coordinator")
    try:
        info = await worker.start()
    except (RegistrationError, ControlKeyError) as exc:
        log.error("registration failed", error=str(exc))
        await worker.close()
        return 1
    assert worker.control is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.control.request_stop)
    freeze_heap()  # the model and imports, out of every later full collection's walk
    sys.stdout.write(READY_PREFIX + json.dumps(info) + "\n")
    sys.stdout.flush()
    try:
        await worker.serve()
    except WorkerFailed as exc:
        log.error("worker failed; exiting", error=str(exc))
        return 1
    log.info("stopped")
    return 0


def core_leases(settings: WorkerSettings) -> CoreLeases | None:
    """The worker's core leases, where it lends or borrows cores (--lend-cores, --borrow-cores);
    ValueError names a bad setting (the lease directory's trust, a borrowed CPU of its own)."""
    if not (settings.lend_cores or settings.borrow_cores):
        return None
    kernels = cpu_ext.load()
    leases = CoreLeases(
        settings.core_lease_dir,
        lend=settings.lend_cores,
        borrow=settings.borrow_cores,
        place_team=getattr(kernels, "place_team", None),
    )
    log.info(
        "core leases",
        directory=settings.core_lease_dir,
        lends=leases.home if leases.lends else [],
        borrows=settings.borrow_cores if leases.borrows else (),
    )
    return leases
