"""A random paged-KV scenario and a naive dense attention to check the kernels against."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tests.kernels.conftest import DEVICE

NUM_LAYERS = 2
LAYER = 1  # tests use the second layer so every view is genuinely strided


@dataclass
class PagedKV:
    """B sequences' dense K/V (``[len_b, Hkv, D]`` each), also written into a block-major cache
    whose unused slots hold ``unused``, through shuffled (non-contiguous) block tables padded with -1."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    kv_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor

    @property
    def k_cache(self) -> torch.Tensor:
        return self.kv_cache[:, LAYER, 0]

    @property
    def v_cache(self) -> torch.Tensor:
        return self.kv_cache[:, LAYER, 1]

    def finite_caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V layer views of a copy of the cache with NaN slots zeroed (what the torch path needs)."""
        finite = self.kv_cache.nan_to_num(nan=0.0)
        return finite[:, LAYER, 0], finite[:, LAYER, 1]


def make_paged(
    seq_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
    unused: float = 1.0e4,
) -> PagedKV:
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks nobody owns
    kv_cache = torch.full(
        (num_blocks, NUM_LAYERS, 2, block_size, num_kv_heads, head_dim), unused, dtype=dtype
    )
    order = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.full((len(seq_lens), max(blocks_per_seq) + 2), -1, dtype=torch.int32)
    keys, values = [], []
    for b, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq, strict=True)):
        ids, order = order[:nb], order[nb:]
        table[b, :nb] = torch.tensor(ids, dtype=torch.int32)
        k, v = (torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype) for _ in range(2))
        for pos in range(n):
            kv_cache[ids[pos // block_size], LAYER, 0, pos % block_size] = k[pos]
            kv_cache[ids[pos // block_size], LAYER, 1, pos % block_size] = v[pos]
        keys.append(k.to(DEVICE))
        values.append(v.to(DEVICE))
    return PagedKV(
        keys,
        values,
        kv_cache.to(DEVICE),
        table.to(DEVICE),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
    )


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain float64 attention of ``q`` ``[M, Hq, D]`` (the last M positions) over ``k``/``v``
    ``[L, Hkv, D]``: softmax(q k^T * scale + causal mask) v, kv heads repeated for GQA."""
    m, num_q_heads, _ = q.shape
    length = k.shape[0]
    group = num_q_heads // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,lhd->hml", q.double(), k) * scale
    q_pos = torch.arange(length - m, length, device=q.device)
    allowed = torch.arange(length, device=q.device)[None, :] <= q_pos[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hml,lhd->mhd", scores.softmax(-1), v)


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, in float64."""
    return float((actual.double() - expected.double()).abs().max() / expected.double().abs().max())


def cu_seqlens(q_lens: list[int]) -> torch.Tensor:
    """``[B+1]`` int32 prefix sums of the new-token counts, starting at 0."""
    return torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
