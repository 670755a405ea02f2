"""Per-sequence view of the block pool: block tables, slot growth and prefix-cache matching."""

from __future__ import annotations

from engine.block_pool import BlockPool, hash_block
from engine.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Owned by one scheduler; the only code that changes a sequence's `block_table`.

    Every block a sequence holds is released by exactly one `free(seq)` call (finish, abort or
    preemption), which empties the table so a second call is a no-op.
    """

    def __init__(self, pool: BlockPool, model_identity: str, enable_prefix_caching: bool = True) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.model_identity = model_identity
        self.enable_prefix_caching = enable_prefix_caching

    def match_prefix(self, seq: Sequence) -> int:
        """Share the longest cached prefix of a fresh sequence; returns the tokens it covers.

        At least one token is always left to compute, since its logits are needed for sampling.
        """
        return self._share(seq, self._cached_prefix(seq))

    def reserve(self, seq: Sequence) -> list[int] | None:
        """All or nothing: share a fresh sequence's cached prefix and take fresh blocks for the rest of
        its `num_tokens` tokens. Returns the fresh ids (they hold KV positions from `num_cached_tokens`
        on); None when the pool is short, with the sequence and the pool (free-list order included)
        unchanged."""
        hit = self._cached_prefix(seq)
        need = cdiv(seq.num_tokens, self.block_size) - len(hit)
        revived = sum(1 for block_id in hit if self.pool.ref_count(block_id) == 0)
        if need > self.pool.num_free_blocks - revived:
            seq.block_hashes.clear()
            return None
        self._share(seq, hit)
        fresh = self.pool.allocate(need)
        assert fresh is not None, "counted above"
        seq.block_table.extend(fresh)
        return fresh

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow the table to hold `num_computed_tokens + num_new_tokens`; False (no change) if short."""
        need = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(seq.block_table)
        if need <= 0:
            return True
        ids = self.pool.allocate(need)
        if ids is None:
            return False
        seq.block_table.extend(ids)
        return True

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register every block that became full and computed, so later requests can share it."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        first_new = len(seq.block_hashes)
        self._extend_hashes(seq, num_full)
        for i in range(first_new, num_full):
            self.pool.cache_block(seq.block_table[i], seq.block_hashes[i], self._block_tokens(seq, i))

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; cached blocks stay findable until evicted."""
        if seq.block_table:
            self.pool.free(seq.block_table)
        seq.block_table = []

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Ids of the cached blocks a fresh sequence can share (none without prefix caching); leaves
        `seq.block_hashes` covering exactly those blocks. Takes no references."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return []
        num_full = (seq.num_tokens - 1) // self.block_size
        self._extend_hashes(seq, num_full)
        token_blocks = [self._block_tokens(seq, i) for i in range(num_full)]
        hit = self.pool.lookup(seq.block_hashes[:num_full], token_blocks)
        del seq.block_hashes[len(hit) :]  # hashes past the hit are registered as blocks get computed
        return hit

    def _share(self, seq: Sequence, hit: list[int]) -> int:
        self.pool.touch(hit)
        seq.block_table = list(hit)
        seq.num_computed_tokens = seq.num_cached_tokens = len(hit) * self.block_size
        return seq.num_computed_tokens

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def _block_tokens(self, seq: Sequence, i: int) -> list[int]:
        return seq.token_ids[i * self.block_size : (i + 1) * self.block_size]

    def _extend_hashes(self, seq: Sequence, num_full: int) -> None:
        while len(seq.block_hashes) < num_full:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.append(hash_block(parent, self._block_tokens(seq, i), self.model_identity))
