"""The agent's one-sided pull ops (kvtransfer.pull), for the tests and kvbench: a mixin of `Agent`.

A sender agent exposes its pool once (`pull_expose`) and opens a `PullSendSession` over filled
source blocks (`pull_source`); a receiver agent reserves blocks into a `PullRecvSession`
(`pull_reserve`) and reads chunks of them (`pull`), or a whole prompt and its end in one request
(`pull_whole`, what kvbench's model rows clock). `mark_done`, `wait_recv`, `ack`, `wait_send` and
`abort` are the agent's session ops, shared with the push sessions.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import torch

from engine.block_pool import BlockPool
from kvtransfer.bench.pattern import fill_blocks, fill_sentinel
from kvtransfer.plan import new_session_secret
from kvtransfer.pull import MappedPool, PoolSource, PullRecvSession, PullSendSession
from kvtransfer.session import RecvSession, SendSession, SessionConfig, SessionKey
from kvtransfer.transport import Transport


class PullOps:
    """Needs the agent's transport, pool, cache and session tables."""

    transport: Transport
    pool: BlockPool
    cache: torch.Tensor
    recv_sessions: dict[SessionKey, RecvSession | PullRecvSession]
    send_sessions: dict[SessionKey, SendSession | PullSendSession]
    _peer: Callable[[str], Any]
    op_mark_done: Callable[..., Awaitable[dict[str, Any]]]
    op_wait_recv: Callable[..., Awaitable[dict[str, Any]]]
    _pool_map: MappedPool | None = None
    # every pull session this agent received in, ended ones included (a test pulls on an ended one)
    pull_recv: dict[SessionKey, PullRecvSession]

    def _mapped(self) -> MappedPool:
        """The whole cache mapped once for the agent's life, as a worker maps it (kvtransfer.pull)."""
        if self._pool_map is None:
            self._pool_map = MappedPool(self.transport, self.cache)
        return self._pool_map

    async def op_pull_expose(self) -> dict[str, Any]:
        source = self._mapped().source()
        return {"rkey": source.rkey.hex(), "base": source.base, "length": source.length}

    async def op_pull_source(
        self,
        rid: str,
        gen: int,
        peer: str,
        num_blocks: int,
        seed: int = 0,
        config: dict[str, Any] | None = None,
        checksums: bool = True,
    ) -> dict[str, Any]:
        """Allocate and fill `num_blocks` source blocks held by a PullSendSession; their ids and (if
        `checksums`) CRCs."""
        ids = self.pool.allocate(num_blocks)
        if ids is None:
            raise RuntimeError(f"cannot allocate {num_blocks} blocks")
        fill_blocks(self.cache, ids, seed)
        session = PullSendSession(
            self._peer(peer), SessionKey(rid, gen), new_session_secret(), self.cache, ids, num_blocks,
            self.pool.free, self._mapped(), SessionConfig(**(config or {})),
        )  # fmt: skip
        self.send_sessions[session.key] = session
        return {"src_ids": ids, "checksums": session.checksums() if checksums else None}

    async def op_pull_reserve(
        self, rid: str, gen: int, n_blocks: int, peer: str, source: dict[str, Any],
        config: dict[str, Any] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """Reserve `n_blocks` (sentinel-filled) into a PullRecvSession reading from `source`
        (`pull_expose`'s answer)."""
        ids = self.pool.allocate(n_blocks)
        if ids is None:
            raise RuntimeError(f"cannot reserve {n_blocks} blocks")
        fill_sentinel(self.cache, ids)
        pool_source = PoolSource(bytes.fromhex(source["rkey"]), int(source["base"]), int(source["length"]))
        session = PullRecvSession(
            self._peer(peer), SessionKey(rid, gen), new_session_secret(), self.cache, ids, self.pool.free,
            self._mapped(), pool_source, SessionConfig(**(config or {})),
        )  # fmt: skip
        self.recv_sessions[session.key] = self.pull_recv[session.key] = session
        return {"block_ids": ids, "state": session.state.value}

    async def op_pull(self, rid: str, gen: int, start: int, src_ids: list[int]) -> dict[str, Any]:
        """Post the reads of one chunk (KVChunkReady); the session (or the key, if it ended) decides."""
        return {"gets": self.pull_recv[SessionKey(rid, gen)].pull(start, src_ids)}

    async def op_pull_prompt(
        self, rid: str, gen: int, src_ids: list[int], chunk_blocks: int
    ) -> dict[str, Any]:
        """Post the reads of a whole prompt, one `pull` per chunk of `chunk_blocks` (as D does per
        KVChunkReady), without waiting between chunks; the number of gets posted."""
        session = self.pull_recv[SessionKey(rid, gen)]
        step = max(1, chunk_blocks)
        return {"gets": sum(session.pull(s, src_ids[s : s + step]) for s in range(0, len(src_ids), step))}

    async def op_pull_whole(
        self, rid: str, gen: int, src_ids: list[int], chunk_blocks: int, checksums: list[int] | None = None
    ) -> dict[str, Any]:
        """A prompt's whole pull in one control round trip, as nixl-raw's `read_blocks` is one: every
        chunk's reads (`pull_prompt`), the sender's KVDone (`mark_done`, with its `checksums` if
        any), then the session's end (`wait_recv`, which frees the blocks). The gets posted, `done`."""
        gets = (await self.op_pull_prompt(rid, gen, src_ids, chunk_blocks))["gets"]
        await self.op_mark_done(rid, gen, first_token=1, checksums=checksums)
        ended = await self.op_wait_recv(rid, gen)
        return {"gets": gets, "done": ended["done"]}
