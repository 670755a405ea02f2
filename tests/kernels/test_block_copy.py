"""gather_blocks / scatter_blocks: Triton and torch paths against plain indexing."""

from __future__ import annotations

import pytest
import torch

from kernels import gather_blocks, scatter_blocks
from kernels.block_copy import word_rows
from tests.kernels.conftest import DEVICE

# (cache shape, dtype): block-major KV shapes, odd block counts, and rows whose byte
# counts force 8-, 4-, 2- and 1-byte words.
CASES = [
    ((7, 3, 2, 5, 2, 8), torch.float32),
    ((9, 2, 2, 5, 3, 3), torch.float32),
    ((5, 3, 7), torch.bfloat16),
    ((6, 3, 7), torch.uint8),
]


def _cache(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=g, dtype=dtype).to(DEVICE)
    return torch.randn(shape, generator=g).to(dtype).to(DEVICE)


@pytest.mark.usefixtures("backend")
@pytest.mark.parametrize(("shape", "dtype"), CASES)
def test_gather_matches_indexing(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    cache = _cache(shape, dtype, seed=1)
    ids = torch.tensor([4, 0, 2, 3], dtype=torch.int32, device=DEVICE)
    out = gather_blocks(cache, ids)
    assert out.shape == (4, *shape[1:]) and out.is_contiguous()
    assert torch.equal(out, cache[ids.long()])


@pytest.mark.usefixtures("backend")
@pytest.mark.parametrize(("shape", "dtype"), CASES)
def test_scatter_inverts_gather(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    cache = _cache(shape, dtype, seed=2)
    src = _cache((3, *shape[1:]), dtype, seed=3)
    ids = torch.tensor([3, 1, 4], dtype=torch.int64, device=DEVICE)
    expected = cache.clone()
    expected[ids] = src
    scatter_blocks(cache, ids, src)
    assert torch.equal(cache, expected)
    assert torch.equal(gather_blocks(cache, ids), src)


@pytest.mark.usefixtures("backend")
def test_gather_into_misaligned_byte_buffer() -> None:
    """``out`` may be any contiguous buffer of the right byte size, even at an odd address."""
    cache = _cache((7, 2, 2, 5, 2, 8), torch.float32, seed=4)
    ids = torch.tensor([6, 2, 5], device=DEVICE)
    block_bytes = cache[0].numel() * 4
    backing = torch.zeros(3 * block_bytes + 1, dtype=torch.uint8, device=DEVICE)
    buf = backing[1:]
    assert word_rows((cache, buf), (7, 3), block_bytes)[0].dtype == torch.uint8
    assert gather_blocks(cache, ids, out=buf) is buf
    assert torch.equal(buf.view(3, -1), cache[ids].reshape(3, -1).view(torch.uint8))
    restored = torch.zeros_like(cache)
    scatter_blocks(restored, ids, buf)
    assert torch.equal(restored[ids], cache[ids])
    assert not restored[torch.tensor([0, 1, 3, 4], device=DEVICE)].any()


def test_rejects_wrong_sizes_and_layouts() -> None:
    cache = _cache((5, 4, 3), torch.float32, seed=5)
    ids = torch.tensor([1, 2], device=DEVICE)
    with pytest.raises(ValueError, match="bytes"):
        gather_blocks(cache, ids, out=torch.empty(3, 4, 3, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous"):
        scatter_blocks(cache, ids, torch.empty(4, 3, 2, device=DEVICE).transpose(0, 2))
    with pytest.raises(ValueError, match="contiguous"):
        gather_blocks(cache.transpose(1, 2), ids)


def test_empty_id_list_is_a_no_op() -> None:
    cache = _cache((5, 4, 3), torch.float32, seed=6)
    ids = torch.empty(0, dtype=torch.int32, device=DEVICE)
    assert gather_blocks(cache, ids).shape == (0, 4, 3)
    before = cache.clone()
    scatter_blocks(cache, ids, torch.empty(0, 4, 3, device=DEVICE))
    assert torch.equal(cache, before)
