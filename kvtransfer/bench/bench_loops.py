"""kvbench's raw loops: many tagged messages of one size between two agents, and the memcpy baseline.

Both the transfers and the baseline rotate through a ring of buffers that together exceed the
last-level cache several times over, so neither measures the cache (a 4 MiB copy of one buffer
runs from the cache at twice the speed of memory).
"""

from __future__ import annotations

import asyncio
import math
import resource
import statistics
import time
import zlib
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kernels import host_memory
from kvtransfer.transport import Peer, PostedRecv, Transport
from splitserve.stats import percentiles

LLC_FALLBACK_BYTES = 32 << 20
MAX_POSTED = 64


def llc_bytes() -> int:
    """Size of the largest CPU cache (the LLC) from sysfs; 32 MiB if unknown."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip()
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(sizes, default=LLC_FALLBACK_BYTES)


def default_ring_bytes() -> int:
    """What a ring holds unless told otherwise: 4x the LLC, so no buffer is still cached when reused."""
    return 4 * llc_bytes()


def ring_count(size: int, ring_bytes: int | None = None) -> int:
    """Buffers in a ring of `size`-byte buffers that together hold at least `ring_bytes` (default:
    4x the LLC); never fewer than two."""
    return max(2, math.ceil((ring_bytes or default_ring_bytes()) / size))


def cpu_seconds() -> float:
    """User + system CPU of this process, all threads (UCX's progress thread included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def ring_buffers(size: int, count: int, device: str = "cpu") -> list[torch.Tensor]:
    """`count` zeroed `size`-byte buffers, consecutive rows of one `host_memory.zeros` slab: on host
    memory they lie on huge pages even when one buffer is smaller than a huge page, as the blocks of
    a KV pool do (a 1 MiB buffer allocated alone gets 4 KiB pages, and a copy between processes then
    looks up 256 pages a message; docs/kvtransfer.md, "Ring buffers on huge pages")."""
    return list(host_memory.zeros((count, size), torch.uint8, device).unbind())


def new_ring(
    size: int, seed: int | None, device: str = "cpu", ring_bytes: int | None = None
) -> list[torch.Tensor]:
    """A ring of `size`-byte buffers (`ring_buffers`), zeroed, or filled from `seed`. Seeded buffers
    are windows of one random stream shifted by one byte each, so every buffer differs (a misplaced
    message fails the checksums) and filling a ring of many GiB costs a copy, not a random draw per
    byte."""
    count = ring_count(size, ring_bytes)
    stream = None if seed is None else np.random.default_rng(seed).integers(0, 256, size + count, np.uint8)
    ring = ring_buffers(size, count, device)
    if stream is not None:
        for j, buf in enumerate(ring):
            buf.copy_(torch.from_numpy(stream[j : j + size]))
    if torch.device(device).type == "cuda":  # UCX's copies run on streams of their own
        torch.cuda.synchronize(device)
    return ring


def ring_checksums(ring: list[torch.Tensor], used: int) -> list[int]:
    return [zlib.crc32(buf.cpu().numpy().data) for buf in ring[:used]]


def percentiles_us(samples: list[float]) -> dict[str, float]:
    """p50, p99 and p99.9 of `samples` (seconds) in microseconds, nearest rank (splitserve.stats)."""
    p50, p99, p999 = percentiles(samples, (50, 99, 99.9))
    return {"p50_us": p50 * 1e6, "p99_us": p99 * 1e6, "p999_us": p999 * 1e6}


def memcpy_gbps(size: int, duration_s: float, ring_bytes: int | None = None, device: str = "cpu") -> float:
    """Single-thread memcpy bandwidth (10^9 bytes/s) over rings of `size`-byte buffers, allocated
    as the transfers' rings are; on a CUDA `device`, a device-to-device `copy_` between two rings."""
    if torch.device(device).type == "cuda":
        return _d2d_gbps(size, duration_s, ring_bytes, device)
    count = ring_count(size, ring_bytes)
    src, dst = ([buf.numpy() for buf in ring_buffers(size, count)] for _ in range(2))
    for j, s in enumerate(src):
        s.fill(j % 256)
    for s, d in zip(src, dst, strict=True):  # first touch outside the timed loop
        np.copyto(d, s)
    n, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < duration_s or n < len(src):
        np.copyto(dst[n % len(dst)], src[n % len(src)])
        n += 1
    return n * size / elapsed / 1e9


def _d2d_gbps(size: int, duration_s: float, ring_bytes: int | None, device: str) -> float:
    """`copy_` between two rings on one GPU, in batches of one ring's length, synchronized before
    the clock is read (the copies are asynchronous)."""
    src = [
        torch.full((size,), j % 256, dtype=torch.uint8, device=device)
        for j in range(ring_count(size, ring_bytes))
    ]
    dst = [torch.empty_like(s) for s in src]
    for s, d in zip(src, dst, strict=True):
        d.copy_(s)
    torch.cuda.synchronize(device)
    n, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < duration_s or n < len(src):
        for s, d in zip(src, dst, strict=True):
            d.copy_(s)
        n += len(src)
        torch.cuda.synchronize(device)
    return n * size / elapsed / 1e9


class BenchLoops:
    """The raw-loop requests of an agent; one ring per side, rebuilt when the size changes."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self._ring: list[torch.Tensor] = []
        self.landed = 0  # bench messages received over this agent's life

    async def op_landed(self) -> dict[str, Any]:
        """How many bench messages landed so far (a test's readiness probe for a running stream)."""
        return {"landed": self.landed}

    def _peer(self, address: str) -> Peer:
        peer = self.transport.peer(address)
        if peer is None:
            raise RuntimeError(f"no peer {address}")
        return peer

    async def op_ring(
        self, size: int, seed: int | None = None, device: str = "cpu", ring_bytes: int | None = None
    ) -> dict[str, Any]:
        """Allocate a fresh ring (seeded on the sender, zeroed on the receiver) of at least
        `ring_bytes` (default: 4x the LLC)."""
        self._ring = []  # free the previous ring first
        self._ring = new_ring(size, seed, device, ring_bytes)
        return {"ring": len(self._ring)}

    async def op_bench_recv(
        self, peer: str, iters: int, tag_base: int, verify: bool = False
    ) -> dict[str, Any]:
        """Post `iters` receives (at most MAX_POSTED ahead, never two on one buffer) and time them."""
        ring, remote = self._ring, self._peer(peer)
        window = min(len(ring), MAX_POSTED)
        loop = asyncio.get_running_loop()
        landed_at: list[float] = []

        async def land(posted: PostedRecv) -> None:
            if not await posted.wait():
                raise RuntimeError("a bench receive was cancelled")
            landed_at.append(loop.time())
            self.landed += 1

        pending: deque[asyncio.Future[None]] = deque()
        cpu0 = cpu_seconds()
        try:
            for i in range(iters):
                if len(pending) >= window:
                    await pending.popleft()
                posted = remote.post_recv(tag_base + i, ring[i % len(ring)])
                pending.append(asyncio.ensure_future(land(posted)))
        finally:  # a lost peer fails every posted receive: collect them all, report the first
            outcomes = await asyncio.gather(*pending, return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        cpu = cpu_seconds() - cpu0
        span = landed_at[-1] - landed_at[0] if len(landed_at) > 1 else 0.0
        checksums = ring_checksums(ring, min(iters, len(ring))) if verify else None
        return {"span_s": span, "cpu_s": cpu, "checksums": checksums}

    async def op_bench_send(
        self, peer: str, iters: int, tag_base: int, depth: int, verify: bool = False
    ) -> dict[str, Any]:
        """Send `iters` messages with `depth` in flight; per-message latency from send to completion."""
        ring, remote = self._ring, self._peer(peer)
        slots = asyncio.Semaphore(depth)
        latencies: list[float] = []
        failures: list[Exception] = []

        async def one(i: int) -> None:
            try:
                t0 = time.perf_counter()
                await remote.send(tag_base + i, ring[i % len(ring)])
                latencies.append(time.perf_counter() - t0)
            except Exception as e:
                failures.append(e)
                raise
            finally:
                slots.release()

        sends = []
        cpu0, t0 = cpu_seconds(), time.perf_counter()
        for i in range(iters):
            await slots.acquire()
            if failures:  # the peer is gone: stop issuing, report the first failure below
                break
            sends.append(asyncio.ensure_future(one(i)))
        await asyncio.gather(*sends)
        elapsed, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
        checksums = ring_checksums(ring, min(iters, len(ring))) if verify else None
        return {
            "elapsed_s": elapsed,
            "cpu_s": cpu,
            "first_us": latencies[0] * 1e6,
            "mean_us": statistics.fmean(latencies) * 1e6,
            "checksums": checksums,
            **percentiles_us(latencies),
        }
