"""Block gather/scatter: pack non-contiguous KV blocks into one buffer and back.

kvtransfer uses these to stage blocks of the block-major ``kv_cache``
(``[num_blocks, ...]``, contiguous) into a registered send buffer and to unpack
a received buffer into reserved blocks. A block is copied as raw bytes, so any
dtype works. The caller owns every tensor passed in; ``gather_blocks`` without
``out`` allocates a new tensor that the caller then owns.

Block ids must be in ``[0, num_blocks)``: the torch path raises on a bad id,
the Triton path does not check (it would read or write out of bounds).
"""

from __future__ import annotations

import torch

from kernels.dispatch import use_triton

# Widest first: one word per load/store keeps the copy memory-bound, not issue-bound.
_WORD_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


def _block_bytes(cache: torch.Tensor) -> int:
    if not cache.is_contiguous():
        raise ValueError("cache must be contiguous with blocks on dim 0")
    if cache.dim() < 1:
        raise ValueError("cache needs a block dimension")
    return cache[0].numel() * cache.element_size() if cache.shape[0] else 0


def _check_packed(t: torch.Tensor, n: int, block_bytes: int, cache: torch.Tensor, name: str) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if t.device != cache.device:
        raise ValueError(f"{name} is on {t.device}, cache on {cache.device}")
    if t.numel() * t.element_size() != n * block_bytes:
        raise ValueError(
            f"{name} holds {t.numel() * t.element_size()} bytes, {n} blocks need {n * block_bytes}"
        )


def word_rows(tensors: tuple[torch.Tensor, ...], rows: tuple[int, ...], row_bytes: int) -> list[torch.Tensor]:
    """Views each contiguous tensor as ``[rows_i, words]`` of the widest integer word
    that divides ``row_bytes`` and every tensor's address."""
    word = next(
        w
        for w in _WORD_DTYPES
        if row_bytes % w.itemsize == 0 and all(t.data_ptr() % w.itemsize == 0 for t in tensors)
    )
    return [
        t.reshape(-1).view(torch.uint8).view(word).view(r, -1) for t, r in zip(tensors, rows, strict=True)
    ]


def gather_blocks(
    cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Returns ``out`` with ``out[i] = cache[block_ids[i]]`` for each of the n ids.

    Without ``out`` the result is a new contiguous ``[n, *cache.shape[1:]]`` tensor.
    ``out`` may be any contiguous tensor on the cache's device holding exactly
    ``n`` blocks' bytes (e.g. a flat uint8 registered buffer); it is filled and returned.
    """
    n = block_ids.numel()
    block_bytes = _block_bytes(cache)
    if out is None:
        out = cache.new_empty((n, *cache.shape[1:]))
    else:
        _check_packed(out, n, block_bytes, cache, "out")
    if n == 0 or block_bytes == 0:
        return out
    src, dst = word_rows((cache, out), (cache.shape[0], n), block_bytes)
    ids = block_ids.reshape(-1).to(cache.device)
    if use_triton(cache):
        from kernels.block_copy_triton import copy_rows_triton

        copy_rows_triton(src, dst, ids, ids_index_src=True)
    else:
        torch.index_select(src, 0, ids.long(), out=dst)
    return out


def scatter_blocks(cache: torch.Tensor, block_ids: torch.Tensor, src: torch.Tensor) -> None:
    """Writes ``cache[block_ids[i]] = src[i]`` in place, for each of the n ids.

    ``src`` is any contiguous tensor on the cache's device holding exactly ``n``
    blocks' bytes. Ids must be distinct (which duplicate wins is unspecified).
    """
    n = block_ids.numel()
    block_bytes = _block_bytes(cache)
    _check_packed(src, n, block_bytes, cache, "src")
    if n == 0 or block_bytes == 0:
        return
    dst, packed = word_rows((cache, src), (cache.shape[0], n), block_bytes)
    ids = block_ids.reshape(-1).to(cache.device)
    if use_triton(cache):
        from kernels.block_copy_triton import copy_rows_triton

        copy_rows_triton(packed, dst, ids, ids_index_src=False)
    else:
        dst.index_copy_(0, ids.long(), packed)
