"""Attention over the paged KV cache: decode (one query per sequence) and varlen prefill.

Shapes (T new tokens over B sequences, Hq query heads, Hkv kv heads, D head dim):
- ``q``: ``[B, Hq, D]`` (decode) or ``[T, Hq, D]`` (prefill; sequence b's tokens are
  rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``, ``cu_seqlens_q`` ``[B+1]`` int32 from 0 to T).
- ``k_cache``/``v_cache``: one layer's ``[num_blocks, block_size, Hkv, D]`` strided views.
- ``block_tables``: ``[B, max_blocks]`` int32; entries past a sequence's last block
  must be -1 or a valid block id (the Triton kernel never reads them).
- ``seq_lens``: ``[B]`` int32, kv tokens of each sequence INCLUDING the new ones, whose
  KV must already be in the cache (``write_kv_slots`` first).
Query head ``i`` attends with kv head ``i // (Hq // Hkv)`` (GQA). New token ``j`` of
sequence b sits at position ``seq_lens[b] - q_len_b + j`` and sees keys ``0..`` that
position (causal). Softmax and accumulation run in float32; the output has q's dtype.

On the CPU, decode over float32 or bfloat16 caches runs the C++ kernel of ``kernels.cpu_ext``
(blocks read in place, online softmax in float32), also for the decode rows of a mixed batch;
each prompt chunk gathers its own blocks and takes one ``scaled_dot_product_attention`` in the
cache's dtype (torch's CPU flash attention: bf16 GEMMs, float32 softmax). The ``*_ref`` functions
are the float32 oracles the tests hold every path to, and the fallback where no kernel serves.
The CPU paths read the unused tail of each sequence's last block (masked out), so the cache must
hold finite values there: allocate it with ``torch.zeros``, never ``torch.empty`` (a NaN
would survive the mask as 0 * NaN). The Triton kernels never read those slots.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels.dispatch import cpu_kernels, use_triton

# (q, k_cache, v_cache, block_tables, seq_lens, scale) -> out: one query token per sequence
DecodeAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor
]


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode attention: one new token per sequence; returns ``[B, Hq, D]``."""
    if use_triton(q):
        from kernels.attention_triton import paged_attention_triton

        cu_seqlens_q = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
        return paged_attention_triton(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, 1)
    cpp = cpu_kernels(q)
    if cpp is not None and k_cache.dtype == v_cache.dtype == q.dtype and q.shape[-1] % 8 == 0:
        return cpp.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
    return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Causal varlen attention of new tokens over their paged prefix; returns ``[T, Hq, D]``.

    Serves mixed batches: a decode token is a sequence with one new token.
    ``max_query_len`` (the largest ``q_len_b``) spares a device sync when given.
    """
    if q.shape[0] == 0 or seq_lens.numel() == 0:
        return torch.empty_like(q)
    if not use_triton(q):
        # decode rows through the decode kernel (C++ where it serves), each prompt chunk its own SDPA
        args = (q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale)
        return _split_prefill(*args, decode=paged_decode_attention, chunks=_prefill_chunks_sdpa)
    from kernels.attention_triton import paged_attention_triton

    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    return paged_attention_triton(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, max_query_len
    )


def _gather_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded ``[B, Hkv, L, D]`` K and V (L = max seq len rounded up to whole blocks) and the
    ``[B, L]`` valid-key mask."""
    num_seqs, block_size = seq_lens.numel(), k_cache.shape[1]
    max_len = int(seq_lens.max())
    table = block_tables[:, : -(-max_len // block_size)].clamp(min=0).long().flatten()
    # One row per block: index_select on 2-D rows is ~10x faster on CPU than on the 4-D view.
    k, v = (
        cache.flatten(1).index_select(0, table).view(num_seqs, -1, *cache.shape[2:]).transpose(1, 2)
        for cache in (k_cache, v_cache)
    )
    # keys stay padded to whole blocks: CPU SDPA is several times faster on such lengths than on
    # a ragged max_len slice, and the mask hides the tail either way
    valid = torch.arange(k.shape[2], device=seq_lens.device)[None, :] < seq_lens[:, None]
    return k, v, valid


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """``q`` ``[B, Hq, M, D]``, ``k``/``v`` ``[B, Hkv, L, D]``, boolean ``mask`` ``[B, 1, M, L]``."""
    out_dtype = q.dtype
    if not q.dtype == k.dtype == v.dtype == torch.float32:
        q, k, v = q.float(), k.float(), v.float()
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    return out.to(out_dtype)


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Torch reference of ``paged_decode_attention``.

    The query heads sharing a kv head ride as that head's query rows (``[B, Hkv, G, D]``), so one
    plain SDPA call serves GQA without ``enable_gqa``: on CPU that is ~2.5x faster for one token.
    """
    k, v, valid = _gather_kv(k_cache, v_cache, block_tables, seq_lens)
    num_seqs, num_heads, head_dim = q.shape
    grouped = q.view(num_seqs, k.shape[1], num_heads // k.shape[1], head_dim)
    return _sdpa(grouped, k, v, valid[:, None, None, :], scale).reshape(num_seqs, num_heads, head_dim)


def paged_prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Torch reference of ``paged_prefill_attention``: float32 math, every sequence's queries padded
    to the batch's longest (sequences with one new token take the decode reference)."""
    args = (q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale)
    return _split_prefill(*args, decode=paged_decode_attention_ref, chunks=_padded_prefill_ref)


# (q, k_cache, v_cache, block_tables, q_lens, seq_lens, scale) -> out: sequences with >1 new token
PrefillChunks = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float],
    torch.Tensor,
]


def _split_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    decode: DecodeAttention,
    chunks: PrefillChunks,
) -> torch.Tensor:
    """Varlen prefill as two calls: sequences with one new token through ``decode`` (so decode
    tokens in a mixed batch cost no padding), the prompt chunks through ``chunks``."""
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    single = q_lens == 1
    if bool(single.all()):
        return decode(q, k_cache, v_cache, block_tables, seq_lens, scale)
    if not bool(single.any()):
        return chunks(q, k_cache, v_cache, block_tables, q_lens, seq_lens, scale)
    single_token = torch.repeat_interleave(single, q_lens)
    multi = ~single
    out = torch.empty_like(q)
    out[single_token] = decode(
        q[single_token], k_cache, v_cache, block_tables[single], seq_lens[single], scale
    )
    out[~single_token] = chunks(
        q[~single_token], k_cache, v_cache, block_tables[multi], q_lens[multi], seq_lens[multi], scale
    )
    return out


def _prefill_chunks_sdpa(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    q_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The CPU forward path for prompt chunks: one SDPA per sequence over its own keys, in the
    cache's dtype (torch's CPU flash attention keeps scores, softmax and sums in float32 and runs
    bfloat16 GEMMs on the matrix units: 2-4x the float32 upcast), causal without a mask when the
    chunk has no cached prefix (the kernel then skips the blocks above the diagonal)."""
    out = torch.empty_like(q)
    start = 0
    for row, (q_len, seq_len) in enumerate(zip(q_lens.tolist(), seq_lens.tolist(), strict=True)):
        k, v, _ = _gather_kv(k_cache, v_cache, block_tables[row : row + 1], seq_lens[row : row + 1])
        chunk = q[start : start + q_len].transpose(0, 1)[None]
        if q_len == seq_len:  # keys past the prompt sit past every query: top-left causal is exact
            mask, causal = None, True
        else:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            mask, causal = torch.arange(k.shape[2], device=q.device)[None, :] <= q_pos[:, None], False
        attended = F.scaled_dot_product_attention(
            chunk, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
        )
        out[start : start + q_len] = attended[0].transpose(0, 1)
        start += q_len
    return out


def _padded_prefill_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    q_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Prefill attention with every sequence's queries padded to ``[B, max q_len]``."""
    num_seqs, device = q_lens.numel(), q.device
    if q.shape[0] == 0:
        return torch.empty_like(q)
    max_query_len = int(q_lens.max())
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=device), q_lens)
    starts = torch.cumsum(q_lens, 0) - q_lens
    row_of_token = torch.arange(q.shape[0], device=device) - starts[seq_of_token]
    q_pad = q.new_zeros((num_seqs, max_query_len, *q.shape[1:]))
    q_pad[seq_of_token, row_of_token] = q
    k, v, _ = _gather_kv(k_cache, v_cache, block_tables, seq_lens)
    # Row i of sequence b sits at position seq_lens[b] - q_len_b + i; padded rows
    # attend to whatever the mask allows and are dropped below.
    q_pos = (seq_lens.long() - q_lens)[:, None] + torch.arange(max_query_len, device=device)
    mask = torch.arange(k.shape[2], device=device)[None, None, :] <= q_pos[:, :, None]
    out = _sdpa(q_pad.transpose(1, 2), k, v, mask[:, None], scale)
    return out.transpose(1, 2)[seq_of_token, row_of_token]
