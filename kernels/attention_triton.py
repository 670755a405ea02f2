"""Triton kernel behind ``paged_decode_attention`` and ``paged_prefill_attention``.

One kernel serves both (decode is the one-new-token case). Program ``(tile, b, h)``
owns ``TOKENS`` consecutive new tokens of sequence b and all ``GROUP = Hq // Hkv``
query heads that share kv head h, packed as the rows of one ``[BLOCK_M, D]`` tile:

    row r  ->  token  tile * TOKENS + r // GROUP,  query head  h * GROUP + r % GROUP

so each K/V tile is loaded once per group. Keys are walked in ``BLOCK_N`` tiles;
key n is read from page ``block_tables[b, n // PAGE]`` at offset ``n % PAGE``, so a
tile may span pages and any page size works. Online softmax in float32 (exp2).
Head dims are padded to a power of two (masked), so any head dim works.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dispatch import next_pow2

_LOG2E = 1.4426950408889634
_DECODE_ROWS = 16  # tl.dot needs at least 16 rows
_PREFILL_ROWS = 64
_BLOCK_N = 64


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    head_dim,
    GROUP: tl.constexpr,
    TOKENS: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tile = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + b)
    q_len = tl.load(cu_seqlens_q_ptr + b + 1) - q_start
    first = tile * TOKENS
    if first >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    context = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    token = first + rows // GROUP
    head = h * GROUP + rows % GROUP
    row_ok = (rows < TOKENS * GROUP) & (token < q_len)
    q_pos = context + token
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q_rows = (q_start + token).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    key_end = tl.minimum(seq_len, context + first + TOKENS)  # keys the tile's last token sees
    table = block_tables_ptr + b.to(tl.int64) * stride_bt
    for n_start in range(0, key_end, BLOCK_N):
        n = n_start + tl.arange(0, BLOCK_N)
        n_ok = n < key_end
        page = tl.load(table + n // PAGE, mask=n_ok, other=0).to(tl.int64)
        offset = n % PAGE
        kv_ok = n_ok[:, None] & d_ok[None, :]
        k = tl.load(
            k_cache_ptr
            + page[:, None] * stride_kb
            + offset[:, None] * stride_ks
            + h * stride_kh
            + d[None, :],
            mask=kv_ok,
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
        s = tl.where((n[None, :] <= q_pos[:, None]) & n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr
            + page[:, None] * stride_vb
            + offset[:, None] * stride_vs
            + h * stride_vh
            + d[None, :],
            mask=kv_ok,
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
) -> torch.Tensor:
    """Launches the kernel; arguments as in ``kernels.attention`` (q ``[T, Hq, D]``)."""
    if any(t.stride(-1) != 1 for t in (q, k_cache, v_cache)) or block_tables.stride(-1) != 1:
        raise ValueError("paged attention needs unit stride on head_dim and block_tables rows")
    if not q.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(f"q is {q.dtype}, caches {k_cache.dtype}/{v_cache.dtype}: tl.dot needs one dtype")
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q)
    num_seqs = seq_lens.numel()
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_m = max(_DECODE_ROWS if max_query_len == 1 else _PREFILL_ROWS, next_pow2(group))
    tokens = block_m // group
    grid = (triton.cdiv(max_query_len, tokens), num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        cu_seqlens_q,
        seq_lens,
        scale * _LOG2E,
        *q.stride()[:2],
        *out.stride()[:2],
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        head_dim,
        GROUP=group,
        TOKENS=tokens,
        PAGE=k_cache.shape[1],
        BLOCK_M=block_m,
        BLOCK_N=_BLOCK_N,
        BLOCK_D=max(16, next_pow2(head_dim)),
        num_warps=4,
        num_stages=2,  # float32 K/V tiles at three stages can overflow shared memory
    )
    return out
