"""write_kv_slots: Triton and torch paths against a per-token loop, on strided layer views."""

from __future__ import annotations

import pytest
import torch

from kernels import write_kv_slots
from tests.kernels.conftest import DEVICE
from tests.kernels.paged import LAYER, NUM_LAYERS

# (block_size, num_kv_heads, head_dim)
CASES = [(16, 2, 64), (5, 3, 80), (16, 1, 128)]


@pytest.mark.usefixtures("backend")
@pytest.mark.parametrize(("block_size", "num_kv_heads", "head_dim"), CASES)
def test_writes_each_token_to_its_slot_and_skips_padding(
    block_size: int, num_kv_heads: int, head_dim: int
) -> None:
    g = torch.Generator().manual_seed(block_size + head_dim)
    num_blocks = 7
    kv_cache = torch.randn(num_blocks, NUM_LAYERS, 2, block_size, num_kv_heads, head_dim, generator=g).to(
        DEVICE
    )
    # key/value as strided slices of one fused projection output, as a model produces them.
    qkv = torch.randn(9, 3, num_kv_heads, head_dim, generator=g).to(DEVICE)
    key, value = qkv[:, 1], qkv[:, 2]
    slots = [
        3 * block_size + 2,
        -1,
        0,
        6 * block_size + block_size - 1,
        block_size + 4,
        -1,
        17,
        2,
        5 * block_size,
    ]
    slot_mapping = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    expected = kv_cache.clone()
    for t, slot in enumerate(slots):
        if slot >= 0:
            expected[slot // block_size, LAYER, 0, slot % block_size] = key[t]
            expected[slot // block_size, LAYER, 1, slot % block_size] = value[t]
    write_kv_slots(key, value, kv_cache[:, LAYER, 0], kv_cache[:, LAYER, 1], slot_mapping)
    assert torch.equal(kv_cache, expected)


def test_rejects_mismatched_shapes() -> None:
    kv_cache = torch.zeros(3, NUM_LAYERS, 2, 4, 2, 8, device=DEVICE)
    key = torch.zeros(2, 2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_slots(key, key, kv_cache[:, 0, 0], kv_cache[:, 0, 1], torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="does not fit"):
        write_kv_slots(key[:, :1], key[:, :1], kv_cache[:, 0, 0], kv_cache[:, 0, 1], torch.zeros(2))


@pytest.mark.usefixtures("force_cpp")
def test_bfloat16_keys_are_copied_into_bfloat16_caches_bit_exact() -> None:
    """The C++ path takes bfloat16 keys and caches too (a bfloat16 model's every step): a copy."""
    g = torch.Generator().manual_seed(3)
    kv_cache = torch.randn(4, NUM_LAYERS, 2, 16, 3, 64, generator=g).to(torch.bfloat16)
    qkv = torch.randn(5, 3, 3, 64, generator=g).to(torch.bfloat16)
    key, value = qkv[:, 1], qkv[:, 2]
    slots = [0, 17, -1, 63, 40]
    expected = kv_cache.clone()
    for t, slot in enumerate(slots):
        if slot >= 0:
            expected[slot // 16, LAYER, 0, slot % 16] = key[t]
            expected[slot // 16, LAYER, 1, slot % 16] = value[t]
    mapping = torch.tensor(slots, dtype=torch.int64)
    write_kv_slots(key, value, kv_cache[:, LAYER, 0], kv_cache[:, LAYER, 1], mapping)
    assert torch.equal(kv_cache, expected)
