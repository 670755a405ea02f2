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
each prompt chunk over a bfloat16 cache on an AVX512-BF16 CPU takes the C++ flash-attention kernel
(keys read through the block table, ``vdpbf16ps`` scores and value sums in float32, online softmax in
float32, probabilities rounded to bfloat16 for the values as GPU kernels do: 2.5-3x torch's CPU
SDPA), and any other gathers its own blocks and takes one ``scaled_dot_product_attention`` in the
cache's dtype (torch's CPU flash attention: float32 softmax). Which rows decode, which
blocks each chunk reads and its causal mask are the same in every layer of a step: a
``VarlenLayout`` holds them, built once a step on the host (the model runner builds it from the
lists it already has; without one, ``paged_prefill_attention`` builds it with one device sync). The ``*_ref`` functions
are the float32 oracles the tests hold every path to, and the fallback where no kernel serves.
The CPU paths read the unused tail of each sequence's last block (masked out), so the cache must
hold finite values there: allocate it with ``torch.zeros``, never ``torch.empty`` (a NaN
would survive the mask as 0 * NaN). The Triton kernels never read those slots.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from kernels import cpu_features
from kernels.dispatch import cpu_kernels, use_triton


@dataclass(frozen=True, slots=True)
class PromptChunk:
    """One sequence of a varlen step with more than one new token."""

    rows: slice  # its rows of the step's flat tokens
    seq_len: int  # its tokens, the new ones included
    blocks: torch.Tensor  # [ceil(seq_len / block_size)] int64: the blocks its keys are in, in order
    causal_mask: torch.Tensor | None  # [q_len, keys padded to blocks]; None: nothing cached (top-left)


@dataclass(frozen=True, slots=True)
class VarlenLayout:
    """A varlen step's shape, the same in every layer: the sequences with one new token (decode
    rows, through the decode kernel) and each prompt chunk. Built once a step by its owner (the
    model runner), read by every layer's attention, dropped with the step."""

    decode_seqs: slice | torch.Tensor  # batch rows (block_tables, seq_lens) of single-token sequences
    decode_rows: slice | torch.Tensor  # their rows of the flat tokens
    num_decodes: int
    chunks: tuple[PromptChunk, ...]
    max_query_len: int

    @classmethod
    def build(
        cls, q_lens: Seq[int], seq_lens: Seq[int], block_tables: torch.Tensor, block_size: int
    ) -> VarlenLayout:
        """From host lists (no device sync). Single-token sequences that lead the batch are sliced,
        anywhere else indexed."""
        device = block_tables.device
        decode_seqs, decode_rows, chunks, start = [], [], [], 0
        for seq, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
            if q_len == 1:
                decode_seqs.append(seq)
                decode_rows.append(start)
            else:
                num_blocks = -(-seq_len // block_size)
                mask = None
                if q_len != seq_len:  # a cached prefix: row i sits at seq_len - q_len + i
                    q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
                    mask = torch.arange(num_blocks * block_size, device=device)[None, :] <= q_pos[:, None]
                blocks = block_tables[seq, :num_blocks].long()
                chunks.append(PromptChunk(slice(start, start + q_len), seq_len, blocks, mask))
            start += q_len
        n = len(decode_seqs)
        leading = decode_seqs == list(range(n))
        return cls(
            slice(0, n) if leading else torch.tensor(decode_seqs, dtype=torch.long, device=device),
            slice(0, n) if leading else torch.tensor(decode_rows, dtype=torch.long, device=device),
            n,
            tuple(chunks),
            max(q_lens, default=0),
        )

    @classmethod
    def of(
        cls, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int
    ) -> VarlenLayout:
        """From the step's device tensors (one sync for their host copies)."""
        cu = cu_seqlens_q.tolist()
        q_lens = [b - a for a, b in itertools.pairwise(cu)]
        return cls.build(q_lens, seq_lens.tolist(), block_tables, block_size)


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
    layout: VarlenLayout | None = None,
) -> torch.Tensor:
    """Causal varlen attention of new tokens over their paged prefix; returns ``[T, Hq, D]``.

    Serves mixed batches: a decode token is a sequence with one new token. ``layout`` (the step's,
    built once for all its layers) spares a device sync and the per-layer bookkeeping when given.
    """
    if q.shape[0] == 0 or seq_lens.numel() == 0:
        return torch.empty_like(q)
    if use_triton(q):
        from kernels.attention_triton import paged_attention_triton

        if layout is not None:
            max_query_len = layout.max_query_len
        else:
            max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
        return paged_attention_triton(
            q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, max_query_len
        )
    if layout is None:
        layout = VarlenLayout.of(cu_seqlens_q, seq_lens, block_tables, k_cache.shape[1])
    # decode rows through the decode kernel (C++ where it serves), each prompt chunk its own SDPA
    if not layout.chunks:
        return paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
    out = torch.empty_like(q)
    if layout.num_decodes:
        seqs = layout.decode_seqs
        out[layout.decode_rows] = paged_decode_attention(
            q[layout.decode_rows], k_cache, v_cache, block_tables[seqs], seq_lens[seqs], scale
        )
    cpp = _bf16_prompt_kernels(q, k_cache, v_cache)
    for chunk in layout.chunks:
        rows = q[chunk.rows]
        out[chunk.rows] = (
            cpp.prefill_attention_bf16(rows, k_cache, v_cache, chunk.blocks, chunk.seq_len, scale)
            if cpp is not None
            else _chunk_sdpa(rows, k_cache, v_cache, chunk, scale)
        )
    return out


def _bf16_prompt_kernels(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> ModuleType | None:
    """The C++ module where its bfloat16 prompt kernel serves these tensors (an AVX512-BF16 CPU
    without AMX tiles, bfloat16 query and caches, head dim a multiple of 32 up to 256), else None.
    With AMX, torch's CPU flash attention runs its GEMMs on the tiles: a 1,024-token prompt of the
    real-shape model took 586 against 825 ms in all on one core of a 2-core Xeon (session 33)."""
    cpp = cpu_kernels(q, (torch.bfloat16,))
    serves = (
        cpp is not None
        and not cpu_features.has_amx_bf16()
        and k_cache.dtype == v_cache.dtype == torch.bfloat16
        and q.shape[-1] % 32 == 0
        and q.shape[-1] <= 256
        and bool(cpp.has_bf16_dot())
    )
    return cpp if serves else None


def _chunk_sdpa(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, chunk: PromptChunk, scale: float
) -> torch.Tensor:
    """The CPU forward path for one prompt chunk: one SDPA over its own keys, in the cache's dtype
    (torch's CPU flash attention keeps scores, softmax and sums in float32 and runs bfloat16 GEMMs
    on the matrix units: 2-4x the float32 upcast), causal without a mask when the chunk has no
    cached prefix (the kernel then skips the blocks above the diagonal). Keys stay padded to whole
    blocks: CPU SDPA is several times faster on such lengths than on a ragged slice, and the mask
    (or the causal diagonal) hides the tail."""
    k, v = (
        cache.flatten(1).index_select(0, chunk.blocks).view(1, -1, *cache.shape[2:]).transpose(1, 2)
        for cache in (k_cache, v_cache)
    )
    attended = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k,
        v,
        attn_mask=chunk.causal_mask,
        is_causal=chunk.causal_mask is None,
        scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )
    return attended[0].transpose(0, 1)


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
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    single = q_lens == 1
    single_token = torch.repeat_interleave(single, q_lens)
    multi = ~single
    out = torch.empty_like(q)
    if bool(single.any()):
        out[single_token] = paged_decode_attention_ref(
            q[single_token], k_cache, v_cache, block_tables[single], seq_lens[single], scale
        )
    if bool(multi.any()):
        out[~single_token] = _padded_prefill_ref(
            q[~single_token], k_cache, v_cache, block_tables[multi], q_lens[multi], seq_lens[multi], scale
        )
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
