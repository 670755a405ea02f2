"""Deterministic block contents for kvbench and the tests: a seeded pattern and a sentinel.

The sender fills logical block i of a session from `(seed, i)`; the receiver regenerates the same
bytes to check that every block arrived bit-exact, and blocks nobody may write hold `SENTINEL`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch

SENTINEL = 0xAB


def block_bytes(cache: torch.Tensor) -> torch.Tensor:
    """The cache as `[num_blocks, block_bytes]` uint8 (a view, no copy)."""
    return cache.reshape(cache.shape[0], -1).view(torch.uint8)


@functools.lru_cache(maxsize=4)
def _stream(seed: int, nbytes: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 1_000_003)
    return torch.randint(0, 256, (nbytes,), generator=generator, dtype=torch.uint8)


def pattern(seed: int, index: int, nbytes: int) -> torch.Tensor:
    """Logical block `index`'s bytes: one random stream per (seed, size), rotated by `index`, so
    blocks differ (a misplaced block fails) and a GiB of blocks costs copies, not random draws."""
    return torch.roll(_stream(seed, nbytes), index % nbytes)


def fill_blocks(cache: torch.Tensor, block_ids: Iterable[int], seed: int) -> None:
    """Write the pattern of logical block i into `block_ids[i]`."""
    view = block_bytes(cache)
    for i, block_id in enumerate(block_ids):
        view[block_id].copy_(pattern(seed, i, view.shape[1]))


def blocks_match(cache: torch.Tensor, block_ids: Iterable[int], seed: int) -> bool:
    """True when `block_ids[i]` holds exactly the pattern of logical block i."""
    view = block_bytes(cache)
    return all(torch.equal(view[b].cpu(), pattern(seed, i, view.shape[1])) for i, b in enumerate(block_ids))


def fill_sentinel(cache: torch.Tensor, block_ids: Iterable[int]) -> None:
    block_bytes(cache)[list(block_ids)] = SENTINEL


def is_sentinel(cache: torch.Tensor, block_ids: Iterable[int]) -> bool:
    return bool((block_bytes(cache)[list(block_ids)] == SENTINEL).all())


def blocks_filled_with(cache: torch.Tensor, value: int) -> list[int]:
    """Ids of the blocks whose every byte is `value` (what a foreign message would leave)."""
    return [int(i) for i in (block_bytes(cache) == value).all(dim=1).nonzero().flatten()]
