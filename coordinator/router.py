"""Placement: which prefill worker computes a request's KV, which decode worker receives and decodes it.

Decode worker: the READY one with the most allocatable KV blocks (last report less what was placed
since) that can hold the whole sequence and whose KV layout equals the prefill worker's.

Prefill worker: the READY one with the lowest *estimated TTFT*

    queue_ms + uncached_tokens x cost_per_token
    queue_ms = (queued uncached tokens it reported + tokens placed on it since) x cost_per_token

where cost_per_token is the worker's measured prefill cost (the pool's mean until it has one) and
uncached_tokens is the sequence minus the longest prefix whose chained block hashes the worker
reported in PrefixCacheEvents. A prefix hit on a busy worker therefore loses to an idle worker when
the queue costs more than the recompute (seed 001, "the cache hit that loses"). A colocated worker is
its own decode worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from coordinator.workers import COLOCATED, DECODE, WorkerInfo, WorkerRegistry
from engine.block_pool import hash_block

# used until some prefill worker has measured its cost (microseconds per uncached prompt token)
DEFAULT_PREFILL_US_PER_TOKEN = 100.0


@dataclass(frozen=True, slots=True)
class Placement:
    """The router's choice for one request generation, with the numbers behind it (for logs)."""

    prefill: WorkerInfo  # the colocated worker itself when `colocated`
    decode: WorkerInfo
    cached_tokens: int
    uncached_tokens: int
    estimated_ttft_ms: float
    needed_blocks: int

    @property
    def colocated(self) -> bool:
        return self.prefill is self.decode


def prefix_block_hashes(token_ids: Sequence[int], block_size: int, model_identity: str) -> list[int]:
    """Routing keys of the sequence's full blocks, as workers report them in PrefixCacheEvents: the first
    8 bytes of the engine's chained block hash, little-endian. The last token is never in a cached block
    (its logits are needed), as in the engine's prefix matching."""
    keys, parent = [], None
    for start in range(0, (len(token_ids) - 1) // block_size * block_size, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], model_identity)
        keys.append(int.from_bytes(parent[:8], "little"))
    return keys


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks a decode worker reserves for a sequence of `num_tokens`, plus room for its next token."""
    return -(-(num_tokens + 1) // block_size)


class Router:
    """Stateless policy over the registry; `commit` records what it placed until the next report."""

    def __init__(self, registry: WorkerRegistry) -> None:
        self.registry = registry

    def cost_us_per_token(self, worker: WorkerInfo) -> float:
        if worker.load.prefill_us_per_token > 0:
            return worker.load.prefill_us_per_token
        measured = [w.load.prefill_us_per_token for w in self.registry if w.load.prefill_us_per_token > 0]
        return sum(measured) / len(measured) if measured else DEFAULT_PREFILL_US_PER_TOKEN

    def estimate_ttft(
        self, worker: WorkerInfo, token_ids: Sequence[int], hashes: dict[int, list[int]] | None = None
    ) -> tuple[float, int]:
        """(estimated ms to the first token on `worker`, tokens of the sequence it has cached)."""
        cached = 0
        if worker.prefix_hashes:
            keys = _hashes_for(token_ids, worker.block_size, self.registry.model.identity, hashes)
            for key in keys:
                if key not in worker.prefix_hashes:
                    break
                cached += worker.block_size
        cost_ms = self.cost_us_per_token(worker) / 1e3
        queued = worker.load.queued_tokens + worker.pending_tokens
        return (queued + len(token_ids) - cached) * cost_ms, cached

    def choose_decode(
        self, num_tokens: int, layout_hash: str, exclude: frozenset[str] = frozenset()
    ) -> WorkerInfo | None:
        """The READY decode worker with the most free blocks that fits the sequence, or None."""
        fits = [
            w
            for w in self.registry.ready()
            if w.role == DECODE
            and w.layout_hash == layout_hash
            and w.worker_id not in exclude
            and w.free_blocks_estimate >= blocks_for(num_tokens, w.block_size)
        ]
        if not fits:
            return None
        return min(fits, key=lambda w: (-w.free_blocks_estimate, w.load.running_requests, w.worker_id))

    def place(self, token_ids: Sequence[int]) -> Placement | None:
        """Best (prefill, decode) for the sequence `token_ids` (prompt + output so far), or None when
        no READY pair has room now."""
        hashes: dict[int, list[int]] = {}
        options = []
        for worker in self.registry.ready():
            if worker.does_prefill:
                ttft, cached = self.estimate_ttft(worker, token_ids, hashes)
                options.append((ttft, worker.worker_id, worker, cached))
        for ttft, _, prefill, cached in sorted(options, key=lambda o: (o[0], o[1])):
            if prefill.role == COLOCATED:
                fits = prefill.free_blocks_estimate >= blocks_for(len(token_ids), prefill.block_size)
                decode = prefill if fits else None
            else:
                decode = self.choose_decode(len(token_ids), prefill.layout_hash)
            if decode is not None:
                needed = blocks_for(len(token_ids), decode.block_size)
                return Placement(prefill, decode, cached, len(token_ids) - cached, ttft, needed)
        return None

    def largest_pool_refusal(self, num_tokens: int) -> tuple[int, WorkerInfo] | None:
        """(blocks needed, the largest registered decode-capable pool) when no such pool, of any
        health, could ever hold a sequence of `num_tokens` even when empty; None when one could (or
        when none is registered: that is MODEL_NOT_READY, not a limit)."""
        pools = [w for w in self.registry if w.does_decode]
        if not pools or any(blocks_for(num_tokens, w.block_size) <= w.register.num_blocks for w in pools):
            return None
        largest = max(pools, key=lambda w: (w.register.num_blocks * w.block_size, w.worker_id))
        return blocks_for(num_tokens, largest.block_size), largest

    def commit(self, placement: Placement) -> None:
        placement.prefill.pending_tokens += placement.uncached_tokens
        placement.decode.pending_blocks += placement.needed_blocks

    def commit_decode(self, decode: WorkerInfo, num_tokens: int) -> None:
        decode.pending_blocks += blocks_for(num_tokens, decode.block_size)


def _hashes_for(
    token_ids: Sequence[int], block_size: int, identity: str, memo: dict[int, list[int]] | None
) -> list[int]:
    if memo is None:
        return prefix_block_hashes(token_ids, block_size, identity)
    if block_size not in memo:
        memo[block_size] = prefix_block_hashes(token_ids, block_size, identity)
    return memo[block_size]
