"""Block pool: exact allocation and eviction order, and a randomized integrity fuzz."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_pool import BlockPool, hash_block


def _cached(pool: BlockPool, ids: list[int], parent: bytes | None = None) -> list[bytes]:
    """Register each block in `ids` as a full block of distinct tokens; returns their hashes."""
    hashes = []
    for block_id in ids:
        tokens = [block_id] * pool.block_size
        parent = hash_block(parent, tokens, "model-a")
        pool.cache_block(block_id, parent, tokens)
        hashes.append(parent)
    return hashes


def test_allocation_takes_lowest_ids_first_and_reports_shortage() -> None:
    pool = BlockPool(5, 4)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    assert pool.allocate(1) is None
    assert pool.num_free_blocks == 0
    pool.check_integrity()


def test_shortage_changes_nothing() -> None:
    pool = BlockPool(3, 4)
    pool.allocate(2)
    before = pool.stats()
    assert pool.allocate(2) is None
    assert pool.stats() == before


def test_blank_blocks_are_used_before_cached_ones_are_evicted() -> None:
    pool = BlockPool(4, 2)
    a = pool.allocate(2)
    assert a == [0, 1]
    _cached(pool, a)
    pool.free(a)
    # blocks 2 and 3 are blank: they go first, cached 0/1 survive
    assert pool.allocate(2) == [2, 3]
    assert pool.num_cached_blocks == 2
    # next allocation must evict; the sequence's last block (1) is evicted before its first (0)
    assert pool.allocate(1) == [1]
    assert pool.num_cached_blocks == 1
    assert pool.allocate(1) == [0]
    assert pool.num_cached_blocks == 0
    pool.check_integrity()


def test_eviction_is_least_recently_freed_first() -> None:
    pool = BlockPool(3, 1)
    ids = pool.allocate(3)
    assert ids is not None
    for block_id in ids:
        _cached(pool, [block_id])
    pool.free([2])
    pool.free([0])
    pool.free([1])
    assert [pool.allocate(1) for _ in range(3)] == [[2], [0], [1]]


def test_lookup_touch_and_collision_guard() -> None:
    pool = BlockPool(4, 2)
    ids = pool.allocate(2)
    assert ids is not None
    hashes = _cached(pool, ids)
    pool.free(ids)
    tokens = [[i] * 2 for i in ids]
    assert pool.lookup(hashes, tokens) == ids
    # a hash hit whose tokens differ ends the prefix
    assert pool.lookup(hashes, [tokens[0], [9, 9]]) == [ids[0]]
    pool.touch(ids)
    assert pool.stats()["held"] == 2 and pool.stats()["free"] == 2
    pool.touch(ids[:1])
    assert pool.ref_count(ids[0]) == 2
    pool.free(ids)
    pool.free(ids[:1])
    pool.check_integrity()
    assert pool.num_free_blocks == 4


def test_hash_is_chained_and_keyed_by_model_identity() -> None:
    a = hash_block(None, [1, 2], "model-a")
    assert hash_block(None, [1, 2], "model-a") == a
    assert hash_block(None, [1, 2], "model-b") != a
    assert hash_block(a, [3, 4], "model-a") != hash_block(None, [3, 4], "model-a")


def test_double_free_and_touching_blank_blocks_raise() -> None:
    pool = BlockPool(2, 2)
    ids = pool.allocate(1)
    assert ids is not None
    pool.free(ids)
    with pytest.raises(ValueError, match="freed more times"):
        pool.free(ids)
    with pytest.raises(ValueError, match="allocate it instead"):
        pool.touch(ids)


def test_reset_prefix_cache_keeps_held_blocks() -> None:
    pool = BlockPool(3, 1)
    ids = pool.allocate(2)
    assert ids is not None
    _cached(pool, ids)
    pool.free(ids[:1])
    pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0
    assert pool.ref_count(ids[1]) == 1
    pool.check_integrity()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_randomized_allocate_free_share_keeps_integrity(seed: int) -> None:
    """Random allocations, frees, shares, cache hits revived, cache registrations and resets: the
    pool stays whole (its free-cached count included), and a consumer that takes a snapshot when
    tracking starts and applies every drain of stored/removed hashes always agrees with the cache."""
    rng = random.Random(seed)
    pool = BlockPool(rng.randint(1, 24), rng.choice([1, 2, 4]))
    held: list[list[int]] = []  # each entry: one owner's references
    parents: list[bytes] = []
    tokens_of: dict[bytes, list[int]] = {}
    view: set[bytes] | None = None  # the consumer's copy of the cache, from when tracking starts
    for _ in range(80):
        op = rng.random()
        if op < 0.35:
            got = pool.allocate(rng.randint(0, 5))
            if got is not None:
                held.append(got)
        elif op < 0.55 and held:
            owner = held.pop(rng.randrange(len(held)))
            pool.free(owner)
        elif op < 0.7 and held:
            owner = rng.choice(held)
            block_id = rng.choice(owner) if owner else None
            if block_id is not None:
                tokens = [rng.randint(0, 3) for _ in range(pool.block_size)]
                parent = rng.choice(parents) if parents and rng.random() < 0.5 else None
                h = hash_block(parent, tokens, "m")
                pool.cache_block(block_id, h, tokens)
                parents.append(h)
                tokens_of.setdefault(h, tokens)
        elif op < 0.8 and held:
            owner = rng.choice(held)
            pool.touch(owner)
            held.append(list(owner))
        elif op < 0.9 and parents:  # a prefix-cache hit, possibly on a free block: revive it
            h = rng.choice(parents)
            hit = pool.lookup([h], [tokens_of[h]])
            if hit:
                pool.touch(hit)
                held.append(hit)
        elif op < 0.92:
            pool.reset_prefix_cache()
        if view is None and rng.random() < 0.2:
            pool.track_cache_events()
            view = set(pool.cached_hashes())
        elif view is not None and rng.random() < 0.3:
            events = pool.drain_cache_events()
            assert not events.stored & events.removed
            assert not events.stored & view and events.removed <= view
            view = (view - events.removed) | events.stored
            assert view == set(pool.cached_hashes())
        pool.check_integrity()
        assert pool.num_held_blocks == len({b for owner in held for b in owner})
        free_cached = sum(
            1 for h in pool.cached_hashes() if pool.ref_count(pool.lookup([h], [tokens_of[h]])[0]) == 0
        )
        assert pool.stats()["cached_free"] == free_cached
    for owner in held:
        pool.free(owner)
    pool.check_integrity()
    assert pool.num_free_blocks == pool.num_blocks


def test_cache_events_need_tracking_and_net_out() -> None:
    pool = BlockPool(4, 2)
    with pytest.raises(RuntimeError, match="track_cache_events"):
        pool.drain_cache_events()
    pool.track_cache_events()
    ids = pool.allocate(2)
    assert ids is not None
    first, second = _cached(pool, ids)
    pool.free(ids)
    assert pool.allocate(4) is not None  # evicts both: stored and removed since the last drain
    events = pool.drain_cache_events()
    assert events.stored == set() and events.removed == set()
    assert first != second


def test_allocation_brings_free_successors_along_so_ids_are_consecutive() -> None:
    """A churned free list still yields runs where blank blocks are adjacent (one contiguous range
    per run for kvtransfer); a cached block is never taken out of LRU order; a held one ends a run."""
    pool = BlockPool(16, 1)
    assert pool.allocate(16) == list(range(16))
    pool.free([10, 3, 11, 2, 12])  # the free list: 10, 3, 11, 2, 12 (FIFO would hand them out so)
    assert pool.allocate(4) == [10, 11, 12, 3]  # 10 brings 11 and 12; 13 is held
    _cached(pool, [5])
    pool.free([5])  # cached: at the LRU end
    pool.free([4])  # the free list: 4, 2 | cached 5
    assert pool.allocate(2) == [4, 2]  # 4's successor 5 is cached: left for last
    assert pool.num_cached_blocks == 1
    pool.check_integrity()
