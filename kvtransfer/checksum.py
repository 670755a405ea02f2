"""Optional end-to-end verification: a stable per-block checksum (CRC-32 of the block's bytes)."""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch


def block_checksums(cache: torch.Tensor, block_ids: Sequence[int]) -> list[int]:
    """CRC-32 of each block's raw bytes, in the order of `block_ids`. Same value in every process.

    A CUDA cache is copied to the host block by block (verification is a debug/bench path).
    """
    sums = []
    for block_id in block_ids:
        block = cache[block_id].reshape(-1).view(torch.uint8)
        if block.device.type != "cpu":
            block = block.cpu()
        sums.append(zlib.crc32(block.numpy().data))
    return sums
