"""One-sided pull sessions: the decode side reads the prompt's KV out of the prefill side's pool.

The prefill worker (P) maps its whole KV pool for remote reads once (`MappedPool`, owned by the
worker, closed at shutdown) and tells the decode worker (D), over the authenticated control
plane, the pool's `PoolSource` (packed remote key, base address, length) and, chunk by chunk as
prefill makes blocks final, the source block ids of the request. D alone chooses every destination:
it reads each chunk into the blocks it reserved, one `ucp_get_nbx` per run of blocks consecutive
on both sides (`plan.coalesce_runs`), all posted at once. P's CPU takes no part while bytes move.

    D: PullRecvSession(block_ids)            P: PullSendSession(src ids so far)
       pull(start, src ids) per KVChunkReady --> gets into block_ids[start:...]
       mark_done(first token, checksums)  <-- KVDone
       DONE: D owns the blocks; KVAck     --> acknowledged(): P releases its sources

Abort, lease expiry and peer loss end a session as in kvtransfer.session. D releases its blocks only
after every posted get finished (UCP cannot cancel a get), so no byte lands in a block D no longer
holds. P releases its sources at once on abort: its memory is only ever read, and a read still in
flight belongs to a D session that is aborted and discards what it read.

What is enforced where (docs/kvtransfer.md, "One-sided pull"): the remote key covers P's whole pool
for as long as P runs. D's session refuses any read once it ended (its key is destroyed) and any
source id outside the advertised pool; P cannot stop a D that ignores its own session, on CMA and
shared memory because UCX keys name memory that stays mapped, on RDMA because the key is the pool's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtransfer.errors import PeerLost, SessionAborted, TransportError
from kvtransfer.nixl import NixlTransport
from kvtransfer.nixl_rma import NixlRemoteKey, NixlRma
from kvtransfer.plan import Message, coalesce_runs
from kvtransfer.session import Release, SessionConfig, SessionKey, SessionState, SinkSession, SourceSession
from kvtransfer.transport import Peer, Transport
from kvtransfer.ucx import UcxTransport
from kvtransfer.ucx_rma import GetRun, RemoteKey, Rma, RmaError


@dataclass(frozen=True, slots=True)
class PoolSource:
    """P's KV pool as a reader sees it: packed remote key, base address, length in bytes."""

    rkey: bytes
    base: int
    length: int


def chunk_plan(num_blocks: int) -> list[Message]:
    """The chunking plan of a pull session: one `Message` per logical block, so a KVChunkReady can
    announce every block that is final (reads need no plan both sides derive alike)."""
    return [Message(i, i, i + 1, True) for i in range(num_blocks)]


class MappedPool:
    """This process's KV cache mapped for one-sided reads on the transport (its UCX worker, or its
    NIXL agent: kvtransfer.nixl_rma), once for the worker's life: P's so D can read it, D's so gets
    land in registered memory. The owner (the worker) closes it at shutdown, before closing the
    transport."""

    def __init__(self, transport: Transport, cache: torch.Tensor) -> None:
        if not isinstance(transport, UcxTransport | NixlTransport):
            raise TransportError(
                f"one-sided pull needs the ucx or nixl transfer backend, not {transport.backend}"
            )
        self.rma: Rma | NixlRma = transport.rma
        self.region = self.rma.register(cache)

    def source(self) -> PoolSource:
        """What a reader needs, for the control plane."""
        return PoolSource(self.region.rkey, self.region.address, self.region.length)

    def hold(self, delta: int, linger_s: float = 0.0) -> None:
        """A pull session a peer reads this pool in starts (+1) or ends (-1, its reader may still
        read for `linger_s`) (`PullSendSession`)."""
        self.rma.serve(delta, linger_s)

    def close(self) -> None:
        self.region.close()


class PullSendSession(SourceSession):
    """Prefill side: holds `src_block_ids` (and later `extend_sources`) for D's reads until KVAck
    or abort; sends nothing. Holds `pool` (the `MappedPool` D reads) while it lives."""

    def __init__(
        self,
        peer: Peer,
        key: SessionKey,
        secret: bytes,
        cache: torch.Tensor,
        src_block_ids: Sequence[int],
        num_blocks: int,
        release: Release,
        pool: MappedPool,
        config: SessionConfig | None = None,
    ) -> None:
        super().__init__(peer, key, secret, cache, src_block_ids, num_blocks, [], release, config)
        self._pool: MappedPool | None = pool
        pool.hold(+1)

    def _end(self, state: SessionState, result: int | None = None) -> None:
        super()._end(state, result)
        if self._pool is not None:
            pool, self._pool = self._pool, None
            # acknowledged: every read of D's landed; otherwise D may read until its lease ends
            pool.hold(-1, 0.0 if state is SessionState.DONE else self.config.lease_s)

    async def _finish_abort(self) -> None:
        self._release_once()
        self._end(SessionState.ABORTED)


class PullRecvSession(SinkSession):
    """Decode side: reads P's sources into `block_ids` (reserved by the caller), chunk by chunk."""

    def __init__(
        self,
        peer: Peer,
        key: SessionKey,
        secret: bytes,
        cache: torch.Tensor,
        block_ids: Sequence[int],
        release: Release,
        pool: MappedPool,
        source: PoolSource,
        config: SessionConfig | None = None,
    ) -> None:
        super().__init__(peer, key, secret, cache, block_ids, [], release, config)
        self._pool, self._source = pool, source
        self._block_bytes = cache[0].numel() * cache.element_size()
        self._gets: list[asyncio.Future[None]] = []
        self._pulled = 0
        unpack = getattr(peer, "unpack_rkey", None)
        if unpack is None:
            raise ValueError(f"peer {peer.address} has no one-sided reads (pull needs ucx or nixl)")
        self._rkey: RemoteKey | NixlRemoteKey | None = None
        try:
            self._rkey = unpack(source.rkey)
        except (PeerLost, RmaError) as e:
            self.abort(f"cannot use the peer's remote key: {e}")

    @property
    def blocks_pulled(self) -> int:
        """How many logical blocks have reads posted so far."""
        return self._pulled

    def pull(self, start: int, src_ids: Sequence[int]) -> int:
        """Post the reads of logical blocks `[start, start + len(src_ids))` from P's `src_ids`
        (KVChunkReady); chunks come in order. Returns the number of gets posted.

        Raises SessionAborted once the session ended (its remote key is gone), ValueError for a
        chunk out of order, past the reservation, or naming a block outside P's pool."""
        if self.state is not SessionState.ACTIVE or self._rkey is None:
            raise SessionAborted(self.abort_reason or f"session {self.state.value}")
        if start != self._pulled or start + len(src_ids) > len(self.block_ids):
            raise ValueError(
                f"chunk [{start}, {start + len(src_ids)}) after {self._pulled} of {len(self.block_ids)} blocks"
            )
        pool_blocks = self._source.length // self._block_bytes
        if any(not 0 <= s < pool_blocks for s in src_ids):
            raise ValueError(f"source block ids outside the peer's pool of {pool_blocks} blocks")
        bb, base, dst_base = self._block_bytes, self._source.base, self.cache.data_ptr()
        runs = [
            GetRun(dst_base + r.dst * bb, base + r.src * bb, r.n * bb)
            for r in coalesce_runs(src_ids, self.block_ids[start : start + len(src_ids)], start)
        ]
        # the key (from this session's peer) and the region are of the same backend as rma
        future = self._pool.rma.get(self._rkey, runs, self._pool.region)  # type: ignore[arg-type]
        future.add_done_callback(self._landed)
        self._gets.append(future)
        self._pulled += len(src_ids)
        return len(runs)

    def _landed(self, future: asyncio.Future[None]) -> None:
        if future.exception() is not None:
            self.abort(f"get failed: {future.exception()}")
        else:
            self._maybe_finish()

    def _all_landed(self) -> bool:
        return self._pulled == len(self.block_ids) and all(f.done() for f in self._gets)

    def _on_done(self) -> None:
        self._close_rkey()

    def _close_rkey(self) -> None:
        if self._rkey is not None:
            self._rkey.close()
            self._rkey = None

    async def _finish_abort(self) -> None:
        # Wait (protects an invariant): UCP cannot cancel a get, and a block goes back to the pool
        # only once no read can still land in it.
        await asyncio.gather(*self._gets, return_exceptions=True)
        self._close_rkey()
        self._release_once()
        self._end(SessionState.ABORTED)
