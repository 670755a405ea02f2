"""Paged KV block allocator with refcounts, chained prefix hashes and LRU eviction.

One `BlockPool` per worker owns the ids of every block of that worker's KV cache tensor. Callers
(the KV manager of a scheduler, the decode worker's reservations, a transfer session) get ids from
`allocate`, share them with `touch`, and give them back with `free`; a block returns to the free list
when its refcount reaches zero. Full blocks may be registered in the prefix cache with `cache_block`;
such a block stays reusable (found by `lookup`) while free, until `allocate` evicts it.

Free-list order (front is taken first)::

    [ never-cached free blocks ... | cached free blocks, least recently freed first ... ]

so an allocation consumes blank blocks before it evicts any cached prefix, and evicts the
least recently used prefix first. Within the blank blocks an allocation prefers consecutive ids
(each block taken brings its free blank successors along), so a sequence's blocks form long runs
where the pool has free ranges: kvtransfer moves a run as one message or one one-sided get.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import KeysView, Sequence
from dataclasses import dataclass, field


def hash_block(parent: bytes | None, token_ids: Sequence[int], model_identity: str) -> bytes:
    """Stable hash of one full block, chained through its parent block's hash.

    Uses SHA-256 (never Python's `hash()`), so every process that serves the same model identity
    computes the same value for the same token prefix.
    """
    h = hashlib.sha256()
    h.update(parent if parent is not None else model_identity.encode())
    h.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    return h.digest()


@dataclass(slots=True)
class CacheEvents:
    """Prefix-cache hashes stored and removed since the last drain, each net of the other: a hash
    stored and removed in between appears in neither (a hash is never cached twice at once)."""

    stored: set[bytes] = field(default_factory=set)
    removed: set[bytes] = field(default_factory=set)

    def store(self, block_hash: bytes) -> None:
        if block_hash in self.removed:
            self.removed.discard(block_hash)
        else:
            self.stored.add(block_hash)

    def remove(self, block_hash: bytes) -> None:
        if block_hash in self.stored:
            self.stored.discard(block_hash)
        else:
            self.removed.add(block_hash)


@dataclass(slots=True)
class _Block:
    ref_count: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] = ()


class BlockPool:
    """Allocator for `num_blocks` KV blocks of `block_size` token slots each.

    Backpressure is a return value: `allocate` returns None when the request cannot be met and
    changes nothing. Freeing a block more times than it was referenced is a bug and raises.
    `stats()` is O(1) and, once `track_cache_events()` is called, the cache's changes are kept for
    `drain_cache_events()`: a heartbeat costs what changed, not the pool's size (a walk of a
    100,000-block pool took 48 ms of the event loop per heartbeat).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._blocks = [_Block() for _ in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self._cached_free = 0  # free blocks that still carry a hash (evictable prefix-cache hits)
        self._events: CacheEvents | None = None  # recorded once tracked, for one consumer

    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate` can hand out now (blank ones plus evictable cached ones)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, referenced or not."""
        return len(self._cached)

    def cached_hashes(self) -> KeysView[bytes]:
        """The hash of every cached block, referenced or not (a live view: copy it for a snapshot)."""
        return self._cached.keys()

    @property
    def num_held_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """Take `n` blocks with refcount 1, evicting cached free blocks if needed; None if short.

        Consecutive ids where the pool has them (a run of consecutive ids is one contiguous byte
        range: one message or one one-sided get in kvtransfer): each block taken from the front of
        the free list brings its free blank successors (id + 1, id + 2, ...) along while more are
        needed. Only blank blocks are taken out of list order, so eviction order is unchanged."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            return None
        ids: list[int] = []
        while len(ids) < n:
            block_id, _ = self._free.popitem(last=False)
            ids.append(self._take(block_id))
            successor = block_id + 1
            while len(ids) < n and successor in self._free and self._blocks[successor].block_hash is None:
                del self._free[successor]
                ids.append(self._take(successor))
                successor += 1
        return ids

    def _take(self, block_id: int) -> int:
        """Give a block just removed from the free list refcount 1 (forgetting its cached hash)."""
        block = self._blocks[block_id]
        if block.block_hash is not None:
            self._cached_free -= 1
            self._forget(block)
        block.ref_count = 1
        return block_id

    def _forget(self, block: _Block) -> None:
        """Drop a block's cached hash (its cache map entry included)."""
        assert block.block_hash is not None
        del self._cached[block.block_hash]
        if self._events is not None:
            self._events.remove(block.block_hash)
        block.block_hash, block.token_ids = None, ()

    def touch(self, block_ids: Sequence[int]) -> None:
        """Add one reference to each block (sharing a cached prefix); revives free cached blocks."""
        for block_id in block_ids:
            block = self._blocks[block_id]
            if block.ref_count == 0:
                if block.block_hash is None:
                    raise ValueError(f"block {block_id} is free and uncached: allocate it instead")
                del self._free[block_id]
                self._cached_free -= 1
            block.ref_count += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block. Later blocks of a sequence are evicted first."""
        for block_id in reversed(block_ids):
            block = self._blocks[block_id]
            if block.ref_count <= 0:
                raise ValueError(f"block {block_id} freed more times than it was referenced")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)
                else:
                    self._cached_free += 1

    def cache_block(self, block_id: int, block_hash: bytes, token_ids: Sequence[int]) -> None:
        """Register a full, held block under its chained hash. A hash already cached keeps its block."""
        block = self._blocks[block_id]
        if block.ref_count == 0:
            raise ValueError(f"block {block_id} is not held; only held blocks can be cached")
        if len(token_ids) != self.block_size:
            raise ValueError(f"only full blocks are cached ({len(token_ids)} != {self.block_size} tokens)")
        if block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash, block.token_ids = block_hash, tuple(token_ids)
        self._cached[block_hash] = block_id
        if self._events is not None:
            self._events.store(block_hash)

    def lookup(self, block_hashes: Sequence[bytes], token_blocks: Sequence[Sequence[int]]) -> list[int]:
        """Ids of the longest cached prefix of `block_hashes`, without taking references.

        `token_blocks[i]` are the tokens of block i; a hash hit whose tokens differ (a collision) ends
        the prefix.
        """
        hit: list[int] = []
        for block_hash, tokens in zip(block_hashes, token_blocks, strict=False):
            block_id = self._cached.get(block_hash)
            if block_id is None or self._blocks[block_id].token_ids != tuple(tokens):
                break
            hit.append(block_id)
        return hit

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (e.g. after a weight reload). Held blocks stay held."""
        for block_id in list(self._cached.values()):
            block = self._blocks[block_id]
            self._forget(block)
            if block.ref_count == 0:
                self._free.move_to_end(block_id, last=False)
        self._cached_free = 0

    def track_cache_events(self) -> None:
        """Keep the cache's stored and removed hashes from now on, for `drain_cache_events`."""
        if self._events is None:
            self._events = CacheEvents()

    def drain_cache_events(self) -> CacheEvents:
        """The hashes stored and removed since tracking began or the last drain; starts afresh."""
        if self._events is None:
            raise RuntimeError("cache events are not tracked: call track_cache_events() first")
        events, self._events = self._events, CacheEvents()
        return events

    def check_integrity(self) -> None:
        """Raise AssertionError unless free + held == total and the cache map agrees with the blocks."""
        held = [i for i, b in enumerate(self._blocks) if b.ref_count > 0]
        assert all(b.ref_count >= 0 for b in self._blocks), "negative refcount"
        assert len(held) + len(self._free) == self.num_blocks, (
            f"free ({len(self._free)}) + held ({len(held)}) != total ({self.num_blocks})"
        )
        assert not set(held) & self._free.keys(), "a held block is on the free list"
        for block_hash, block_id in self._cached.items():
            assert self._blocks[block_id].block_hash == block_hash, f"cache map stale for block {block_id}"
        n_hashed = sum(b.block_hash is not None for b in self._blocks)
        assert n_hashed == len(self._cached), "a block carries a hash the cache map does not know"
        order = [self._blocks[i].block_hash is not None for i in self._free]
        assert order == sorted(order), "a cached block precedes a blank block on the free list"
        assert sum(order) == self._cached_free, (
            f"{sum(order)} free cached blocks, counted {self._cached_free}"
        )

    def stats(self) -> dict[str, int]:
        """Counts for metrics and the admin RPC: total, free, held, cached (of which free)."""
        return {
            "total": self.num_blocks,
            "free": len(self._free),
            "held": self.num_held_blocks,
            "cached": len(self._cached),
            "cached_free": self._cached_free,
        }
