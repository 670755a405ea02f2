"""A kvtransfer worker in a process of its own, driven over the control channel (`control.py`).

It owns a transport, a `BlockPool` and a block-major KV cache, and plays the receiver (decode) or
sender (prefill) side of sessions on request, or the raw loops of kvbench (`bench_loops.py`).
kvbench and the kvtransfer tests start two of these and drive them; `kvbench serve` runs one for a
remote `kvbench run --peer`.

    python -m kvtransfer.bench.agent --backend ucx --layout JSON --num-blocks N [--fragment SEED]

On start it prints one line `KVAGENT-READY {"control": ..., "address": ..., "key": ...}` (`key`: its
transfer key, which a peer needs to connect; the control channel is a bench tool's and is not
authenticated) and serves until a
`shutdown` request or death. Every block it allocates returns to its pool on every session path.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
from typing import Any

import structlog
import torch
import zmq
import zmq.asyncio

from engine.block_pool import BlockPool
from kernels import host_memory
from kvtransfer import (
    BACKENDS,
    KVLayout,
    NixlSettings,
    SessionAborted,
    SessionConfig,
    SessionKey,
    UcxSettings,
    create_transport,
    new_session_secret,
)
from kvtransfer.bench import bench_loops
from kvtransfer.bench.control import READY_PREFIX, bind_router, die_with_parent, parse_request
from kvtransfer.bench.get_loops import GetLoops
from kvtransfer.bench.pattern import blocks_filled_with, blocks_match, fill_blocks, fill_sentinel, is_sentinel
from kvtransfer.bench.pull_ops import PullOps
from kvtransfer.checksum import block_checksums
from kvtransfer.pull import PullRecvSession, PullSendSession
from kvtransfer.session import RecvSession, SendSession
from kvtransfer.staging import pool_for
from kvtransfer.transport import Transport
from splitserve.argtypes import positive

log = structlog.get_logger(__name__)


def fragment_pool(pool: BlockPool, seed: int, background: int) -> list[int]:
    """Churn the pool as a long-running worker's: cut it into runs of 1-6 consecutive ids, shuffle
    them, hold `background` blocks of them (other requests' blocks, every third run while needed)
    and free the rest in shuffled order. Free ranges are then short and scattered, whatever the
    allocator prefers; returns the held ids (the agent keeps them for its life)."""
    ids = pool.allocate(pool.num_blocks)
    assert ids is not None
    rng = random.Random(seed)
    runs, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 6)
        runs.append(ids[i : i + n])
        i += n
    rng.shuffle(runs)
    held: list[int] = []
    for j, run in enumerate(runs):
        if j % 3 == 0 and len(held) + len(run) <= background:
            held += run
    kept = set(held)
    for run in reversed(runs):
        if run[0] not in kept:
            pool.free(run)
    return held


class Agent(PullOps, GetLoops):
    """Serves control requests; each request runs as its own task (pull ops: `PullOps`; kvbench's
    one-sided loops: `GetLoops`)."""

    def __init__(
        self,
        transport: Transport,
        pool: BlockPool,
        cache: torch.Tensor,
        background: list[int] | None = None,
        huge_page_share: float | None = None,
    ) -> None:
        """`huge_page_share`: how much of `cache` is on huge pages, read once at start (`info`)."""
        self.transport, self.pool, self.cache = transport, pool, cache
        self.huge_page_share = huge_page_share
        self.background = background or []  # held for the agent's life (fragment_pool)
        self.recv_sessions: dict[SessionKey, RecvSession | PullRecvSession] = {}
        self.send_sessions: dict[SessionKey, SendSession | PullSendSession] = {}
        self.pull_recv = {}
        self.loops = bench_loops.BenchLoops(transport)
        self.stopped = asyncio.Event()

    # -- pool and peers ---------------------------------------------------------------------------

    async def op_pool(self) -> dict[str, Any]:
        try:
            self.pool.check_integrity()
            intact = True
        except AssertionError:
            intact = False
        total = self.pool.num_blocks - len(self.background)  # what sessions may use
        staging = pool_for(self.cache)
        return {
            "free": self.pool.num_free_blocks,
            "total": total,
            "intact": intact,
            "staging_lent": staging.lent,
            "staging_allocated": staging.allocated,
        }

    async def op_connect(self, address: str, key: str) -> dict[str, Any]:
        """Connect to the agent at `address` whose transfer key is `key` (hex, from its `info`)."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        peer = await self.transport.connect(address, bytes.fromhex(key))
        return {"connect_s": loop.time() - t0, "transports": peer.transports}

    async def op_info(self) -> dict[str, Any]:
        t = self.transport
        return {
            "address": t.address,
            "backend": t.backend,
            "key": t.key.hex(),
            "refused": dict(t.refused),
            "huge_page_share": self.huge_page_share,
        }

    async def op_shutdown(self) -> dict[str, Any]:
        self.stopped.set()
        return {}

    def _peer(self, address: str) -> Any:
        peer = self.transport.peer(address)
        if peer is None:
            raise RuntimeError(f"no peer {address}")
        return peer

    @staticmethod
    def _key(rid: str, gen: int) -> SessionKey:
        return SessionKey(rid, gen)

    # -- receiver side ----------------------------------------------------------------------------

    async def op_reserve(
        self,
        rid: str,
        gen: int,
        n_blocks: int,
        peer: str,
        post: bool = True,
        config: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Reserve `n_blocks` (sentinel-filled) and, if `post`, open a RecvSession posting them under
        a fresh session secret, returned (hex) for the sender as Reserved would carry it."""
        ids = self.pool.allocate(n_blocks)
        if ids is None:
            raise RuntimeError(f"cannot reserve {n_blocks} blocks")
        fill_sentinel(self.cache, ids)
        secret = new_session_secret()
        if post:
            session = RecvSession(
                self._peer(peer),
                self._key(rid, gen),
                secret,
                self.cache,
                ids,
                self.pool.free,
                SessionConfig(**(config or {})),
            )
            session.start()
            self.recv_sessions[session.key] = session
        return {
            "block_ids": ids,
            "secret": secret.hex(),
            "messages": len(self.recv_sessions[self._key(rid, gen)].messages) if post else 0,
        }

    async def op_recv_progress(self, rid: str, gen: int) -> dict[str, Any]:
        """Messages landed / planned of an open receive session (a test's readiness probe)."""
        session = self.recv_sessions[self._key(rid, gen)]
        assert isinstance(session, RecvSession), "a pull session has no messages"
        return {"landed": session.messages_landed, "messages": len(session.messages)}

    async def op_free(self, block_ids: list[int]) -> dict[str, Any]:
        self.pool.free(block_ids)
        return {}

    async def op_untouched(self, block_ids: list[int]) -> dict[str, Any]:
        return {"untouched": is_sentinel(self.cache, block_ids)}

    async def op_filled_with(self, value: int) -> dict[str, Any]:
        return {"blocks": blocks_filled_with(self.cache, value)}

    async def op_mark_done(
        self, rid: str, gen: int, first_token: int, checksums: list[int] | None = None
    ) -> dict[str, Any]:
        self.recv_sessions[self._key(rid, gen)].mark_done(first_token, checksums)
        return {}

    async def op_wait_recv(
        self, rid: str, gen: int, seed: int | None = None, keep: bool = False
    ) -> dict[str, Any]:
        """Wait for the session's end; on success check the data against `seed`, free unless `keep`."""
        session = self.recv_sessions.pop(self._key(rid, gen))
        try:
            first_token = await session.wait()
        except SessionAborted as e:
            return {"done": False, "reason": e.reason}
        exact = None if seed is None else blocks_match(self.cache, session.block_ids, seed)
        if not keep:
            self.pool.free(session.block_ids)  # the decode request would own them; here it ends at once
        return {"done": True, "first_token": first_token, "exact": exact}

    # -- sender side ------------------------------------------------------------------------------

    async def op_send(
        self,
        rid: str,
        gen: int,
        peer: str,
        dst_ids: list[int],
        secret: str,
        seed: int = 0,
        upto: int | None = None,
        config: dict[str, Any] | None = None,
        checksums: bool = True,
    ) -> dict[str, Any]:
        """Allocate and fill source blocks, open a SendSession under the receiver's `secret` (hex),
        send up to `upto` blocks."""
        key = self._key(rid, gen)
        if key not in self.send_sessions:
            ids = self.pool.allocate(len(dst_ids))
            if ids is None:
                raise RuntimeError(f"cannot allocate {len(dst_ids)} blocks")
            fill_blocks(self.cache, ids, seed)
            self.send_sessions[key] = SendSession(
                self._peer(peer),
                key,
                bytes.fromhex(secret),
                self.cache,
                ids,
                dst_ids,
                self.pool.free,
                SessionConfig(**(config or {})),
            )
        session = self.send_sessions[key]
        assert isinstance(session, SendSession), "a pull session sends nothing"
        try:
            await session.send(upto)
        except SessionAborted as e:
            return {"sent": False, "reason": e.reason}
        return {
            "sent": True,
            "checksums": block_checksums(self.cache, session.block_ids) if checksums else None,
        }

    async def op_ack(self, rid: str, gen: int) -> dict[str, Any]:
        self.send_sessions.pop(self._key(rid, gen)).acknowledged()
        return {}

    async def op_wait_send(self, rid: str, gen: int) -> dict[str, Any]:
        session = self.send_sessions.pop(self._key(rid, gen))
        try:
            await session.wait()
        except SessionAborted as e:
            return {"done": False, "reason": e.reason}
        return {"done": True}

    async def op_abort(self, rid: str, gen: int, reason: str = "aborted by test") -> dict[str, Any]:
        key = self._key(rid, gen)
        session = self.recv_sessions.pop(key, None) or self.send_sessions.pop(key, None)
        if session is None:
            raise RuntimeError(f"no session {key}")
        session.abort(reason)
        with contextlib.suppress(SessionAborted):
            await session.wait()
        return {"state": session.state.value}

    # -- dispatch ---------------------------------------------------------------------------------

    async def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.pop("op")
        request_id = request.pop("id")
        handler = getattr(self, f"op_{op}", None) or getattr(self.loops, f"op_{op}", None)
        try:
            if handler is None:
                raise ValueError(f"unknown op {op!r}")
            result = await handler(**request)
            return {"id": request_id, "ok": True, **result}
        except Exception as e:
            log.warning("agent request failed", op=op, error=repr(e))
            return {"id": request_id, "ok": False, "error": repr(e)}


async def serve(args: argparse.Namespace) -> None:
    layout = KVLayout.from_dict(json.loads(args.layout))
    settings = UcxSettings(
        progress_mode=args.progress_mode,
        options=dict(kv.split("=", 1) for kv in args.ucx_opt),
        tuned=not args.stock,
        idle_wait_ms=args.ucx_idle_wait_ms,
    )
    nixl = NixlSettings(progress_thread=args.nixl_progress_thread, register=args.nixl_register)
    transport = create_transport(args.backend, layout, settings, nixl=nixl)
    address = await transport.start(args.advertise or args.host, args.port)
    # --fragment: half as many blocks again, held in scattered runs, so --num-blocks stay free
    extra = 0 if args.fragment is None else args.num_blocks // 2
    pool = BlockPool(args.num_blocks + extra, layout.block_size)
    background = [] if args.fragment is None else fragment_pool(pool, args.fragment, extra)
    cache = layout.new_cache(pool.num_blocks, args.device)
    fill_sentinel(cache, range(pool.num_blocks))
    agent = Agent(transport, pool, cache, background, host_memory.report_backing(cache, "kv cache"))
    context = zmq.asyncio.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    info = {
        "control": bind_router(router, args.host, args.control_port, args.control_endpoint),
        "address": address,
        "backend": args.backend,
        "key": transport.key.hex(),
    }
    print(READY_PREFIX + json.dumps(info), flush=True)

    async def answer(identity: bytes, request: dict[str, Any]) -> None:
        await router.send_multipart([identity, json.dumps(await agent.handle(request)).encode()])

    tasks: set[asyncio.Task[None]] = set()
    receiving = asyncio.ensure_future(router.recv_multipart())
    stopping = asyncio.ensure_future(agent.stopped.wait())
    while True:
        await asyncio.wait({receiving, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if receiving.done():
            parsed = parse_request(receiving.result())
            if parsed is None:
                log.warning("malformed control request dropped")
            else:
                task = asyncio.ensure_future(answer(*parsed))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            receiving = asyncio.ensure_future(router.recv_multipart())
        if stopping.done():
            break
    await asyncio.gather(*tasks, return_exceptions=True)
    receiving.cancel()
    await transport.close()
    router.close()
    context.term()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvtransfer.bench.agent", description=__doc__)
    p.add_argument("--backend", choices=BACKENDS, required=True)
    p.add_argument("--layout", required=True, help="KVLayout as JSON")
    p.add_argument("--num-blocks", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="transport port (0: OS-chosen)")
    p.add_argument("--control-port", type=int, default=0, help="control port (0: OS-chosen)")
    p.add_argument("--control-endpoint", default=None, help="bind control here instead (ipc://PATH)")
    p.add_argument("--fragment", type=int, default=None, help="churn the pool with this seed (fragment_pool)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--progress-mode", default=UcxSettings().progress_mode)
    p.add_argument("--ucx-idle-wait-ms", type=positive, default=UcxSettings().idle_wait_ms)
    p.add_argument("--ucx-opt", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--stock", action="store_true", help="UCX with UCXX's stock settings, not ours")
    p.add_argument(
        "--nixl-progress-thread",
        action=argparse.BooleanOptionalAction,
        default=NixlSettings().progress_thread,
    )
    p.add_argument("--nixl-register", default=NixlSettings().register, help="nixl: storage or tensor")
    p.add_argument("--advertise", default=None, help="host peers should dial (default: --host)")
    p.add_argument("--die-with-parent", action="store_true", help="exit when the spawning process dies")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.die_with_parent:
        die_with_parent()
    # Block gathers/scatters are single-row copies: with 2 intra-op threads on a busy 2-core
    # machine torch.index_select measured 0.06 GB/s, with 1 thread 15.8 GB/s.
    torch.set_num_threads(1)
    # stdout carries only the ready line (a parent may stop reading it); logs go to stderr.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
