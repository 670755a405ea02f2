"""A worker's control plane: registration, heartbeats, peers, pool queries, shutdown, message dispatch.

Sockets (splitserve/control.py): a DEALER to the coordinator's ROUTER (identity = worker_id) and this
worker's own ROUTER (`control_address`, advertised in Register) where peers' DEALERs deliver P<->D
messages. Two reader tasks, one per socket, hand every work message to the role in arrival order;
neither ever waits on a model step or a transfer, so an Abort is handled while both are running.

Trust: the DEALER verifies the coordinator's CurveZMQ server key; the ROUTER admits only the keys of
peers the coordinator introduced (engine/worker/peers.py), and a peer message is dropped unless its
routing id and authenticated key belong to the same peer. Malformed frames never reach a handler
(splitserve/control.py); handler failures are dropped and counted, never fatal.

Supervision: the reader and heartbeat tasks never end by themselves. One that does (a socket failed,
a bug) sets `failure`: the worker stops claiming READY (/readyz, heartbeats), deregisters, and
`engine.worker.process.Worker.serve` raises, so the process exits non-zero.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable, Iterable
from typing import Protocol

import structlog
import zmq.asyncio

from engine.block_pool import BlockPool
from engine.worker.convert import pool_state
from engine.worker.metrics import WorkerMetrics
from engine.worker.peers import PeerLinks
from engine.worker.settings import WorkerSettings
from splitserve import wire
from splitserve.control import ControlQueueFull, ControlSocket, CurveKeys, Received, envelope
from splitserve.control_auth import INSECURE_WARNING, ZapHandler, load_keys, load_public_key
from splitserve.v1 import control_pb2, serving_pb2

log = structlog.get_logger(__name__)

_FLUSH_LINGER_MS = 1000

ROLE_PROTO = {
    "prefill": serving_pb2.WORKER_ROLE_PREFILL,
    "decode": serving_pb2.WORKER_ROLE_DECODE,
    "colocated": serving_pb2.WORKER_ROLE_COLOCATED,
}
# The roles a worker exchanges P<->D messages with (its links to them connect when they join).
PARTNERS = {
    "prefill": frozenset({serving_pb2.WORKER_ROLE_DECODE}),
    "decode": frozenset({serving_pb2.WORKER_ROLE_PREFILL}),
    "colocated": frozenset[serving_pb2.WorkerRole.ValueType](),
}


class RegistrationError(RuntimeError):
    """The coordinator refused this worker or never answered; the process exits non-zero."""


class RoleHandler(Protocol):
    """What the control plane needs from the prefill or decode role."""

    async def handle(self, msg: Received) -> None: ...

    async def on_peers_lost(self, worker_ids: set[str]) -> None: ...

    def load(self) -> serving_pb2.WorkerLoad: ...

    def queue_depths(self) -> dict[str, int]: ...


class PrefixEvents:
    """Heartbeat.prefix_cache deltas (hashes' first 8 bytes, LE): the whole cache in the first
    (`cleared`), then what the pool stored and removed since the one before. The pool records its
    changes from the first call on, so a heartbeat costs what changed, never the pool's size."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self._started = False

    def next(self) -> control_pb2.PrefixCacheEvents:
        if not self._started:
            self._started = True
            self.pool.track_cache_events()
            current = _keys(self.pool.cached_hashes())
            return control_pb2.PrefixCacheEvents(cleared=True, stored=wire.pack_hashes(current))
        events = self.pool.drain_cache_events()
        return control_pb2.PrefixCacheEvents(
            stored=wire.pack_hashes(_keys(events.stored)), removed=wire.pack_hashes(_keys(events.removed))
        )


def _keys(hashes: Iterable[bytes]) -> list[int]:
    """The prefix-cache keys the router indexes (first 8 bytes, little-endian), sorted."""
    return sorted(int.from_bytes(h[:8], "little") for h in hashes)


class WorkerControl:
    """A worker's end of the control plane (the coordinator's is `coordinator.control_loop.CoordinatorControl`).
    Created by the worker after its model and transfer listener are up; closed by `close()`."""

    def __init__(
        self,
        settings: WorkerSettings,
        pool: BlockPool,
        kv_layout: control_pb2.KvLayout,
        model_identity: str,
        context_length: int,
        transfer_address: str,
        metrics: WorkerMetrics,
        transfer_key: bytes = b"",
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.pool = pool
        self.kv_layout = kv_layout
        self.model_identity = model_identity
        self.context_length = context_length
        self.transfer_address, self.transfer_key = transfer_address, transfer_key
        self.incarnation = secrets.randbits(64)
        self.keys, coordinator_key = _control_keys(settings)
        self.ctx = zmq.asyncio.Context()
        self.links = PeerLinks(
            self.ctx, settings.worker_id, kv_layout.hash, self.keys, PARTNERS[settings.role]
        )
        self._auth = (
            ZapHandler(self.ctx, self.links.allows, self.links.wait_allowed).start()
            if self.keys is not None
            else None
        )
        self.router = ControlSocket.router(
            self.ctx,
            f"tcp://{settings.advertise_host}:{settings.control_port}",
            keys=self.keys,
            on_drop=lambda reason: metrics.control_dropped.labels("peers", reason).inc(),
        )
        port = self.router.address.rsplit(":", 1)[1]
        self.control_address = f"tcp://{settings.advertise_host}:{port}"
        self.coordinator = ControlSocket.dealer(
            self.ctx,
            settings.coordinator_address,
            settings.worker_id,
            keys=self.keys,
            server_key=coordinator_key,
            on_drop=lambda reason: metrics.control_dropped.labels("coordinator", reason).inc(),
        )
        self.role: RoleHandler | None = None
        self.on_peers: Callable[[list[control_pb2.Peer]], None] = lambda peers: None
        self.registered = False
        self.draining = False
        self.heartbeat_interval_s = 0.5
        self.stop_requested = asyncio.Event()
        self.stop_drain = True
        self.stop_grace_s = settings.drain_timeout_s
        self._prefix = PrefixEvents(pool)  # a decode worker's too: the router weighs prefilling there
        self._heartbeat_seq = 0
        self._tasks: list[asyncio.Task[None]] = []
        self.failure = ""  # why a supervised task ended; the worker cannot serve once set
        self.failed = asyncio.Event()
        self._closing = False

    @property
    def endpoint(self) -> control_pb2.WorkerEndpoint:
        return control_pb2.WorkerEndpoint(
            worker_id=self.settings.worker_id,
            control_address=self.control_address,
            transfer_address=self.transfer_address,
            control_public_key=self.keys.public.decode("ascii") if self.keys is not None else "",
            transfer_key=self.transfer_key,
        )

    async def register(self) -> control_pb2.RegisterAck:
        """Send Register and wait (bounded by --register-timeout) for an accepting RegisterAck."""
        s = self.settings
        await self.to_coordinator(
            envelope(
                register=control_pb2.Register(
                    protocol_version=control_pb2.PROTOCOL_VERSION_1,
                    role=ROLE_PROTO[s.role],
                    endpoint=self.endpoint,
                    incarnation=self.incarnation,
                    model=s.served_model_name,
                    model_identity=self.model_identity,
                    context_length=self.context_length,
                    kv_layout=self.kv_layout,
                    num_blocks=self.pool.num_blocks,
                    transfer_backend=s.transfer_backend,
                    max_prompt_tokens=s.max_prompt_tokens,
                    idle_priority=s.idle_priority,
                )
            )
        )
        try:
            # bounded wait: a coordinator that never answers must not hang the worker's start
            got = await asyncio.wait_for(self._register_ack(), s.register_timeout_s)
        except TimeoutError:
            raise RegistrationError(
                f"no RegisterAck from {s.coordinator} within {s.register_timeout_s}s (is it up, and do "
                "--coordinator-public-key / --insecure-control-plane match the coordinator's?)"
            ) from None
        ack = got.envelope.register_ack
        if not ack.accepted:
            raise RegistrationError(f"the coordinator refused this worker: {ack.reason}")
        if ack.heartbeat_interval_ms:
            self.heartbeat_interval_s = ack.heartbeat_interval_ms / 1e3
        self.links.update(ack.peers)
        self.on_peers(list(ack.peers))
        self.registered = True
        log.info("registered", coordinator=s.coordinator, peers=len(ack.peers))
        return ack

    async def _register_ack(self) -> Received:
        while True:
            got = await self.coordinator.recv()
            if got.kind == "register_ack":
                return got
            log.warning("message before RegisterAck ignored", kind=got.kind)

    def start(self, role: RoleHandler) -> None:
        """Start the two reader tasks and the heartbeat task (after `register`)."""
        self.role = role
        self._tasks = [
            asyncio.create_task(
                self._read(self.coordinator, from_coordinator=True), name="control-coordinator"
            ),
            asyncio.create_task(self._read(self.router, from_coordinator=False), name="control-peers"),
            asyncio.create_task(self._heartbeats(), name="heartbeat"),
        ]
        for task in self._tasks:
            task.add_done_callback(self._task_ended)

    def _task_ended(self, task: asyncio.Task[None]) -> None:
        """Supervision: a reader or the heartbeat ended on its own; this worker cannot serve any more."""
        if self._closing or self.failure:
            return
        error = "cancelled" if task.cancelled() else repr(task.exception())
        why = f"{task.get_name()} ended: {error}"
        self.failure = why
        log.error("control task died; the worker stops serving", task=task.get_name(), error=why)
        self.failed.set()

    async def to_coordinator(self, env: control_pb2.Envelope) -> None:
        try:
            await self.coordinator.send(env)
        except ControlQueueFull:
            log.error("control queue to the coordinator is full; message dropped", kind=env.WhichOneof("msg"))

    async def to_peer(self, endpoint: control_pb2.WorkerEndpoint, env: control_pb2.Envelope) -> None:
        """Send to a peer worker; raises ControlQueueFull when it is not reading (treat it as failed)."""
        await self.links.dealer(endpoint).send(env)

    async def _read(self, sock: ControlSocket, *, from_coordinator: bool) -> None:
        assert self.role is not None
        while True:
            msg = await sock.recv()  # idle wait for the next message
            if not from_coordinator and not self.links.authentic(msg.sender, msg.user_id):
                sock.drop("unauthenticated", sender=msg.sender, kind=msg.kind)
                continue
            try:
                if from_coordinator and await self._handle_own(msg):
                    continue
                await self.role.handle(msg)
            except Exception as exc:  # one bad message must not stop this reader
                sock.drop(
                    "handler_error", sender=msg.sender, kind=msg.kind, error=repr(exc)[:200], exc_info=True
                )

    async def _handle_own(self, msg: Received) -> bool:
        """The messages the control plane answers itself; False hands the message to the role."""
        assert self.role is not None
        env = msg.envelope
        if msg.kind == "peers":
            lost = self.links.update(env.peers.peers)
            self.on_peers(list(env.peers.peers))
            if lost:
                await self.role.on_peers_lost(lost)
        elif msg.kind == "pool_state_query":
            q = env.pool_state_query
            reply = control_pb2.PoolStateReply(
                query_id=q.query_id,
                worker_id=self.settings.worker_id,
                pool=pool_state(self.pool, check_integrity=q.check_integrity),
                load=self.role.load(),
            )
            await self.to_coordinator(envelope(pool_state_reply=reply))
        elif msg.kind == "shutdown":
            sd = env.shutdown
            log.info("shutdown requested", drain=sd.drain, grace_ms=sd.grace_ms, reason=sd.reason)
            self.request_stop(drain=sd.drain, grace_s=sd.grace_ms / 1e3 if sd.grace_ms else None)
        elif msg.kind == "register_ack":
            log.warning("unexpected RegisterAck after registration ignored")
        else:
            self._learn_peer(msg)  # the peer a work message names (Peers may lag it)
            return False
        return True

    def _learn_peer(self, msg: Received) -> None:
        env = msg.envelope
        if msg.kind == "prefill":
            self.links.learn(env.prefill.decode)
        elif msg.kind == "decode":
            self.links.learn(env.decode.prefill)
        elif msg.kind == "reassign":
            self.links.learn(env.reassign.decode)

    def request_stop(self, *, drain: bool = True, grace_s: float | None = None) -> None:
        """Ask the worker to stop (signal or Shutdown); the worker's main task drains and closes."""
        self.stop_drain = self.stop_drain and drain
        if grace_s is not None:
            self.stop_grace_s = grace_s
        self.stop_requested.set()

    async def _heartbeats(self) -> None:
        assert self.role is not None
        while True:
            await self.send_heartbeat()
            self.metrics.observe_pool(self.pool)
            self.metrics.observe_queues(self.role.queue_depths())
            await asyncio.sleep(self.heartbeat_interval_s)  # the heartbeat period itself

    async def send_heartbeat(self) -> None:
        assert self.role is not None
        self._heartbeat_seq += 1
        hb = control_pb2.Heartbeat(
            worker_id=self.settings.worker_id,
            incarnation=self.incarnation,
            seq=self._heartbeat_seq,
            health=serving_pb2.WORKER_HEALTH_READY if self.ready else serving_pb2.WORKER_HEALTH_DRAINING,
            load=self.role.load(),
            pool=pool_state(self.pool),
        )
        hb.prefix_cache.CopyFrom(self._prefix.next())
        await self.to_coordinator(envelope(heartbeat=hb))

    @property
    def ready(self) -> bool:
        """Registered, not draining, every supervised task alive: what /readyz and heartbeats claim."""
        return self.registered and not self.draining and not self.failure

    async def deregister(self, reason: str) -> None:
        await self.to_coordinator(
            envelope(
                deregister=control_pb2.Deregister(
                    worker_id=self.settings.worker_id, incarnation=self.incarnation, reason=reason
                )
            )
        )

    async def close(self) -> None:
        self._closing = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.links.close()
        # protects an invariant: the last messages (Aborts, Deregister) reach the coordinator; bounded
        self.coordinator.sock.close(linger=_FLUSH_LINGER_MS)
        self.router.close()
        if self._auth is not None:
            self._auth.stop()
        self.ctx.term()


def _control_keys(settings: WorkerSettings) -> tuple[CurveKeys | None, bytes | None]:
    """(own keypair, the coordinator's public key), or (None, None) under --insecure-control-plane."""
    if settings.insecure_control_plane:
        log.warning(INSECURE_WARNING)
        return None, None
    return load_keys(settings.control_key), load_public_key(settings.coordinator_public_key)
