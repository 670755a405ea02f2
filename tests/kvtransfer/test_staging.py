"""The staging pool alone: what it lends, what comes back, what it keeps."""

from __future__ import annotations

import pytest
import torch

from kvtransfer.staging import StagingPool, pool_for

BLOCK = (2, 4, 8)  # 64 float16 elements: 128 bytes a block


DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")),
]


def _pool(max_idle_bytes: int = 1 << 20, device: str = "cpu") -> StagingPool:
    return StagingPool(BLOCK, torch.float16, torch.device(device), max_idle_bytes)


@pytest.mark.parametrize("device", DEVICES)
def test_a_buffer_given_back_is_lent_again_for_the_same_size_class(device: str) -> None:
    # on a GPU, the work queued on a buffer before it came back is done before it is lent again
    pool = _pool(device=device)
    first = pool.take(5)
    assert first.shape == (5, *BLOCK) and first.is_contiguous() and pool.lent == 1
    assert first.device.type == device
    first.fill_(3.0)  # queued on the stream on a GPU
    pool.give(first)
    again = pool.take(7)  # 5 and 7 blocks share the 8-block class
    assert again.data_ptr() == first.data_ptr() and pool.allocated == 1
    assert bool((again[:5] == 3.0).all())
    other = pool.take(9)  # the 16-block class: a buffer of its own
    assert other.data_ptr() != again.data_ptr() and pool.allocated == 2 and pool.lent == 2


def test_a_dropped_buffer_is_never_lent_again() -> None:
    pool = _pool()
    dropped = pool.take(4)
    pool.drop(dropped)  # as a cancelled send does: the peer may still read it
    dropped[:] = 1.0
    fresh = pool.take(4)
    assert fresh.data_ptr() != dropped.data_ptr() and pool.lent == 1
    with pytest.raises(ValueError, match="did not lend"):
        pool.give(dropped)


def test_idle_buffers_beyond_the_cap_are_freed_oldest_first() -> None:
    pool = _pool(max_idle_bytes=2 * 8 * 128)  # two 8-block buffers
    bufs = [pool.take(8) for _ in range(3)]
    ptrs = [b.data_ptr() for b in bufs]
    for b in bufs:
        pool.give(b)
    assert pool.idle_bytes == 2 * 8 * 128
    kept = {pool.take(8).data_ptr(), pool.take(8).data_ptr()}
    assert kept == set(ptrs[1:])  # the first given back was the first freed


def test_a_bad_size_is_refused_and_pools_are_per_block_shape() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        _pool().take(0)
    cache = torch.zeros(4, *BLOCK, dtype=torch.float16)
    assert pool_for(cache) is pool_for(torch.zeros(9, *BLOCK, dtype=torch.float16))
    assert pool_for(cache) is not pool_for(cache.float())
