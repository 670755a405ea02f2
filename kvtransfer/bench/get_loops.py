"""kvbench's `ucx-get` row: the receiver reads the sender's ring with one-sided UCX gets.

The same measurement as the two-sided rows (`bench_loops`, `runner.raw_row`): rings of at least 4x
the LLC on both sides, a warm-up run, `repeats` runs sized to `--duration`, the last one verified
(CRC-32 of every ring buffer on both sides), GB/s from the first to the last completion, latency per
get from post to completion, `depth` gets in flight: `depth` streams, each posting its next get as
soon as its last one completed (as NIXL's row reposts; no task or semaphore per get). The sender
maps each ring buffer once and does nothing while the bytes move; its CPU is still counted (UCX's
progress thread included).

Agent side: `GetLoops` is a mixin of `Agent` (ops `get_expose`, `bench_get`, `get_sender_state`, `gets_done`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from kvtransfer.bench import runner
from kvtransfer.bench.bench_loops import BenchLoops, cpu_seconds, percentiles_us, ring_checksums
from kvtransfer.transport import Transport
from kvtransfer.ucx import UcxPeer, UcxTransport
from kvtransfer.ucx_rma import GetRun, MemRegion

BACKEND = "ucx-get"


class GetLoops:
    """Needs the agent's transport and raw loops (whose ring it reads or exposes)."""

    transport: Transport
    loops: BenchLoops
    _exposed: list[MemRegion] | None = None
    _local: list[MemRegion] | None = None
    gets_done = 0  # bench gets completed over this agent's life

    async def op_gets_done(self) -> dict[str, Any]:
        """How many bench gets completed so far (a test's readiness probe for a running stream)."""
        return {"gets": self.gets_done}

    def _ucx(self) -> UcxTransport:
        if not isinstance(self.transport, UcxTransport):
            raise ValueError("ucx-get needs the ucx backend")
        return self.transport

    def _map_ring(self, previous: list[MemRegion] | None) -> list[MemRegion]:
        for region in previous or []:
            region.close()
        return [self._ucx().rma.register(buf) for buf in self.loops._ring]

    async def op_get_expose(self) -> dict[str, Any]:
        """Sender: map the current ring for remote reads; each buffer's (rkey hex, address)."""
        self._exposed = self._map_ring(self._exposed)
        return {"sources": [[r.rkey.hex(), r.address] for r in self._exposed]}

    async def op_get_sender_state(self, verify: bool = False) -> dict[str, Any]:
        """Sender: its CPU seconds so far and, if `verify`, its ring's checksums."""
        ring = self.loops._ring
        return {"cpu_s": cpu_seconds(), "checksums": ring_checksums(ring, len(ring)) if verify else None}

    async def op_bench_get(
        self, peer: str, sources: list[list[Any]], iters: int, depth: int, verify: bool = False
    ) -> dict[str, Any]:
        """Receiver: `iters` gets of sender buffer i % n into our buffer i % n, `depth` in flight."""
        remote = self.transport.peer(peer)
        if not isinstance(remote, UcxPeer):
            raise RuntimeError(f"no ucx peer {peer}")
        ring, rma = self.loops._ring, self._ucx().rma
        if self._local is None or len(self._local) != len(ring) or self._local[0].length != ring[0].nbytes:
            self._local = self._map_ring(self._local)
        keys = [remote.unpack_rkey(bytes.fromhex(rkey)) for rkey, _ in sources]
        loop = asyncio.get_running_loop()
        latencies: list[float] = []
        done_at: list[float] = []
        failed = False

        # each ring slot's get, built once (as NIXL's row prepares one transfer handle per slot)
        runs = [
            [GetRun(buf.data_ptr(), int(source[1]), buf.nbytes)]
            for buf, source in zip(ring, sources, strict=True)
        ]
        local = self._local

        async def stream(first: int) -> None:
            # one of `depth` streams: gets first, first + depth, ... back to back, each posted as
            # soon as the one before it completed (no task or semaphore per get)
            nonlocal failed
            for i in range(first, iters, depth):
                if failed:
                    return  # the peer is gone: stop posting, report the first failure below
                j = i % len(ring)
                t0 = time.perf_counter()
                try:
                    await rma.get(keys[i % len(keys)], runs[j], local[j])
                except Exception:
                    failed = True
                    raise
                latencies.append(time.perf_counter() - t0)
                done_at.append(loop.time())
                self.gets_done += 1

        cpu0 = cpu_seconds()
        streams = [asyncio.ensure_future(stream(k)) for k in range(min(depth, iters))]
        try:
            await asyncio.gather(*streams)
        finally:
            await asyncio.gather(*streams, return_exceptions=True)
            for key in keys:
                key.close()
        span = done_at[-1] - done_at[0] if len(done_at) > 1 else 0.0
        return {
            "span_s": span,
            "cpu_s": cpu_seconds() - cpu0,
            "first_us": latencies[0] * 1e6,
            "checksums": ring_checksums(ring, min(iters, len(ring))) if verify else None,
            **percentiles_us(latencies),
        }


class GetLane(runner.TwoSidedLane):
    """The `ucx-get` raw rows as `runner.raw_points` drives them: rings as the two-sided rows', which
    the sender then maps for remote reads, and runs of the receiver's gets."""

    _sources: list[list[Any]]  # each sender ring buffer's (rkey hex, address), set by `ring`

    async def ring(self, size: int) -> int:
        buffers = await super().ring(size)
        self._sources = (await self.agents.send.call("get_expose"))["sources"]
        return buffers

    async def run(self, iters: int, depth: int, verify: bool) -> runner.RunReplies:
        """One run as `runner.raw_row` reads it: (receiver side, sender side)."""
        agents, sources = self.agents, self._sources
        before = await agents.send.call("get_sender_state")
        recv = await agents.recv.call(
            "bench_get", peer=agents.sender_address, sources=sources, iters=iters, depth=depth,
            verify=verify, timeout=600,
        )  # fmt: skip
        after = await agents.send.call("get_sender_state", verify=verify)
        used = min(iters, len(sources))
        send = {
            **{k: recv[k] for k in ("first_us", "p50_us", "p99_us", "p999_us")},
            "cpu_s": after["cpu_s"] - before["cpu_s"],
            "checksums": after["checksums"][:used] if verify else None,
        }
        return recv, send
