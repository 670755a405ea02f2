"""The worker's side of the bulk data plane: kvtransfer's transport over this worker's KV cache.

kvtransfer owns the transport (UCX or TCP), the layout descriptor and the transfer sessions; this
module creates them for a worker: one listener, one cached `kvtransfer.Peer` per peer worker (connected
when the peer appears, reused by every request), and the block references a session holds.

Trust (docs/security.md ("The KV data plane")): the listener's transfer key goes out in Register only, and the decode
side connects with the key the prefill worker's WorkerEndpoint carries, so only processes the
authenticated control plane told about a worker can pair with it; each session's secret (drawn by D,
sent to P in Reserved) keeps everyone else's messages out of its posted receives.

Block ownership during a transfer: a session holds its OWN reference on each block it reads or writes
(`hold`), dropped by kvtransfer's exactly-once release callback once no byte can move any more. So the
request's owner (engine sequence, reservation) frees its references whenever it ends, and a block is
reusable only when both are gone: no byte ever lands in (or is read from) a block someone else holds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable

import structlog

from engine.llm_engine import LLMEngine
from engine.worker.metrics import WorkerMetrics
from engine.worker.settings import WorkerSettings
from kvtransfer import (
    KVLayout,
    Peer,
    SessionConfig,
    SessionKey,
    Transport,
    TransportError,
    UcxSettings,
    create_transport,
)
from kvtransfer.lanes import gets_over_tcp
from kvtransfer.pull import MappedPool
from splitserve.v1 import control_pb2

log = structlog.get_logger(__name__)

_ACCEPT_WAIT_S = 5.0
_ACCEPT_POLL_S = 0.005


def kv_layout(engine: LLMEngine) -> KVLayout:
    """kvtransfer's descriptor of this engine's KV cache tensor."""
    cache = engine.runner.kv_cache
    _, num_layers, _, block_size, num_kv_heads, head_dim = cache.shape
    return KVLayout(
        dtype=str(cache.dtype).removeprefix("torch."),
        num_layers=num_layers,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        model_identity=engine.loaded.identity,
    )


def kv_layout_proto(engine: LLMEngine) -> control_pb2.KvLayout:
    """The layout as Register carries it; `hash` is kvtransfer's digest (what peers compare)."""
    layout = kv_layout(engine)
    return control_pb2.KvLayout(
        dtype=layout.dtype,
        num_layers=layout.num_layers,
        block_size=layout.block_size,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        order="block_major",
        hash=layout.digest(),
    )


def session_key(rid: int, generation: int) -> SessionKey:
    """The session's name in both workers' logs and lookups (its tags derive from its secret)."""
    return SessionKey(str(rid), generation)


class TransferPlane:
    """Created (listening) by the worker before it registers, since Register carries its address;
    closed last. Event-loop only."""

    def __init__(
        self, settings: WorkerSettings, engine: LLMEngine, transport: Transport, metrics: WorkerMetrics
    ) -> None:
        self.engine = engine
        self.transport = transport
        self.metrics = metrics
        self.address = transport.address
        self.cache = engine.runner.kv_cache
        self.block_bytes = self.cache[0].numel() * self.cache.element_size()
        self.config = SessionConfig(
            lease_s=settings.lease_ms / 1e3,
            max_message_bytes=settings.kv_message_bytes,
            min_direct_bytes=settings.kv_direct_bytes,
        )
        self.initiates = settings.role == "decode"
        self.pull = settings.pulls
        self.pull_always = settings.kv_transfer_mode == "pull"
        self._mapped: MappedPool | None = None
        self.on_release: Callable[[], None] = lambda: None
        self._connecting: dict[str, asyncio.Task[Peer]] = {}
        transport.on_refused = lambda reason: metrics.kv_connections_refused.labels(reason).inc()

    @classmethod
    async def listen(
        cls, settings: WorkerSettings, engine: LLMEngine, metrics: WorkerMetrics
    ) -> TransferPlane:
        ucx = UcxSettings(progress_mode=settings.ucx_progress_mode, idle_wait_ms=settings.ucx_idle_wait_ms)
        transport = create_transport(settings.transfer_backend, kv_layout(engine), ucx)
        await transport.start(settings.advertise_host, settings.transfer_port)
        plane = cls(settings, engine, transport, metrics)
        if plane.pull:
            plane.mapped_pool()  # before the first request, not during it
        return plane

    def pulls_over(self, peer: Peer) -> bool:
        """Whether this decode worker reads a request's KV itself over `peer`: always under
        `--kv-transfer-mode pull`; under `auto` unless the peer's bulk lanes are all TCP, where a
        UCX get measured 0.31-0.65x NIXL against the push's 0.44-1.13x (docs/kvtransfer.md,
        "Across hosts")."""
        return self.pull and (self.pull_always or not gets_over_tcp(peer.transports))

    def mapped_pool(self) -> MappedPool:
        """This worker's KV cache mapped for one-sided reads (kvtransfer.pull), once, on first use;
        unmapped at close. Raises TransportError on a backend without one-sided reads."""
        if self._mapped is None:
            self._mapped = MappedPool(self.transport, self.cache)
            log.info("kv pool mapped for one-sided reads", bytes=self._mapped.region.length)
        return self._mapped

    def pool_source(self) -> control_pb2.KvPoolSource:
        """How a decode worker reads this worker's pool, as KVChunkReady carries it."""
        source = self.mapped_pool().source()
        return control_pb2.KvPoolSource(rkey=source.rkey, base=source.base, length=source.length)

    async def peer(self, endpoint: control_pb2.WorkerEndpoint) -> Peer:
        """The one kvtransfer peer shared with the worker at `endpoint`; raises TransportError.

        One connection per pair, opened by the decode side (which needs it first: it posts its
        receives before it sends Reserved) with the key `endpoint` carries. The prefill side only
        uses the connection it accepted (which proved it holds our key), registered by the time D's
        Reserved arrives, give or take the accept handler's last step; that is the one short bounded
        wait here.
        """
        address = endpoint.transfer_address
        if not self.initiates:
            return await self._accepted(address)
        cached = self.transport.peer(address)
        if cached is not None and not cached.lost:
            return cached
        task = self._connecting.get(address)
        if task is None:  # one connect per address, however many requests wait for it
            task = asyncio.ensure_future(self.transport.connect(address, endpoint.transfer_key))
            self._connecting[address] = task
            task.add_done_callback(lambda _: self._connecting.pop(address, None))
        return await asyncio.shield(task)

    async def _accepted(self, address: str) -> Peer:
        deadline = time.monotonic() + _ACCEPT_WAIT_S
        while True:
            peer = self.transport.peer(address)
            if peer is not None and not peer.lost:
                return peer
            if time.monotonic() > deadline:
                raise TransportError(f"the decode worker at {address} has no KV connection to this worker")
            # shrinkable: an "accepted" event from kvtransfer would replace this poll
            await asyncio.sleep(_ACCEPT_POLL_S)

    def preconnect(self, endpoints: Iterable[control_pb2.WorkerEndpoint]) -> None:
        """Decode side: connect to new prefill peers now (at registration, not per request)."""
        if not self.initiates:
            return
        for endpoint in endpoints:
            if endpoint.transfer_address and self.transport.peer(endpoint.transfer_address) is None:
                task = asyncio.ensure_future(self.peer(endpoint))
                task.add_done_callback(_log_connect_failure)

    def hold(self, block_ids: list[int]) -> Callable[[list[int]], None]:
        """Take a session's reference on `block_ids`; returns the callback that drops it. The callback
        is idempotent (kvtransfer calls it on abort, the owner after a completed receive; either may
        come first), so the reference is dropped exactly once."""
        pool = self.engine.pool
        pool.touch(block_ids)
        held = [list(block_ids)]

        def release(_: list[int]) -> None:
            if held:
                pool.free(held.pop())
                self.on_release()

        return release

    async def close(self) -> None:
        for task in self._connecting.values():
            task.cancel()
        if self._mapped is not None:
            self._mapped.close()
        await self.transport.close()


def _log_connect_failure(task: asyncio.Task[Peer]) -> None:
    if not task.cancelled() and isinstance(task.exception(), TransportError):
        log.warning("kv peer connect failed", error=str(task.exception()))
