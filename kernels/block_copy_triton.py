"""Triton row copy behind ``gather_blocks`` / ``scatter_blocks`` (see block_copy.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dispatch import next_pow2

_MAX_CHUNK_WORDS = 2048


@triton.jit
def _copy_rows_kernel(src_ptr, dst_ptr, ids_ptr, row_words, IDS_INDEX_SRC: tl.constexpr, CHUNK: tl.constexpr):
    # Program (i, c) copies words [c*CHUNK, (c+1)*CHUNK) of one row.
    i = tl.program_id(0).to(tl.int64)
    block_id = tl.load(ids_ptr + i).to(tl.int64)
    if IDS_INDEX_SRC:
        src_row = block_id
        dst_row = i
    else:
        src_row = i
        dst_row = block_id
    offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < row_words
    vals = tl.load(src_ptr + src_row * row_words + offs, mask=mask)
    tl.store(dst_ptr + dst_row * row_words + offs, vals, mask=mask)


def copy_rows_triton(src: torch.Tensor, dst: torch.Tensor, ids: torch.Tensor, ids_index_src: bool) -> None:
    """``dst[i] = src[ids[i]]`` (gather) or ``dst[ids[i]] = src[i]`` (scatter); 2-D word views."""
    row_words = src.shape[1]
    chunk = min(_MAX_CHUNK_WORDS, next_pow2(row_words))
    grid = (ids.numel(), triton.cdiv(row_words, chunk))
    _copy_rows_kernel[grid](src, dst, ids, row_words, IDS_INDEX_SRC=ids_index_src, CHUNK=chunk)
