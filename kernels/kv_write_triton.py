"""Triton kernel behind ``write_kv_slots`` (see kv_write.py): one program per token."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dispatch import next_pow2


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    num_heads,
    head_dim,
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token
        return
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_heads) & (d < head_dim)
    page = slot // PAGE
    offset = slot % PAGE
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    tl.store(k_cache_ptr + page * stride_kcb + offset * stride_kcs + h * stride_kch + d, k, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(v_cache_ptr + page * stride_vcb + offset * stride_vcs + h * stride_vch + d, v, mask=mask)


def write_kv_slots_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton ``write_kv_slots``; every tensor's last dim must be unit-stride."""
    tensors = (key, value, k_cache, v_cache)
    if any(t.stride(-1) != 1 for t in tensors):
        raise ValueError("write_kv_slots needs unit stride on head_dim")
    num_tokens, num_heads, head_dim = key.shape
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        *key.stride()[:2],
        *value.stride()[:2],
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        num_heads,
        head_dim,
        PAGE=k_cache.shape[1],
        BLOCK_H=next_pow2(num_heads),
        BLOCK_D=next_pow2(head_dim),
    )
