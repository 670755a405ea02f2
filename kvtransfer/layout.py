"""KV layout descriptor: what one block of a worker's KV cache holds, and its stable digest.

Prefill and decode workers exchange the descriptor when they pair (see `Transport.connect`); any
difference refuses the pairing with a `LayoutMismatch` that names the field, since raw block bytes
are only meaningful to a peer that reads them with the same layout.

The only layout order is "block-major" (the shared contract)::

    kv_cache[num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]

so one block is one contiguous byte range holding every layer, and a run of consecutive block ids
is one contiguous byte range too.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from kernels import host_memory
from kvtransfer.errors import LayoutMismatch

BLOCK_MAJOR = "block-major"


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape, dtype and model identity of one worker's KV blocks. Immutable; owned by the worker."""

    dtype: str
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    model_identity: str
    order: str = BLOCK_MAJOR

    def __post_init__(self) -> None:
        if self.order != BLOCK_MAJOR:
            raise ValueError(f"unsupported layout order {self.order!r} (only {BLOCK_MAJOR!r})")
        if not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            raise ValueError(f"unknown torch dtype {self.dtype!r}")
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype)
        assert isinstance(dtype, torch.dtype)
        return dtype

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block: `[num_layers, 2, block_size, num_kv_heads, head_dim]`."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        n = 1
        for d in self.block_shape:
            n *= d
        return n * self.torch_dtype.itemsize

    def new_cache(self, num_blocks: int, device: str | torch.device = "cpu") -> torch.Tensor:
        """A zeroed block-major cache tensor of `num_blocks` blocks (host caches on huge pages, see
        `kernels.host_memory`); the caller owns it."""
        return host_memory.zeros((num_blocks, *self.block_shape), self.torch_dtype, device)

    def check_cache(self, cache: torch.Tensor) -> None:
        """Raise ValueError unless `cache` is a contiguous block-major tensor of this layout."""
        if tuple(cache.shape[1:]) != self.block_shape or cache.dtype != self.torch_dtype:
            raise ValueError(
                f"cache {tuple(cache.shape)} {cache.dtype} does not match layout "
                f"[N, {', '.join(map(str, self.block_shape))}] {self.dtype}"
            )
        if not cache.is_contiguous():
            raise ValueError("the KV cache must be contiguous")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVLayout:
        return cls(**{f.name: d[f.name] for f in fields(cls)})

    def digest(self) -> str:
        """Stable hex digest of every field (SHA-256 of canonical JSON), equal across processes."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()

    def check_compatible(self, theirs: KVLayout) -> None:
        """Raise LayoutMismatch naming the first field where `theirs` differs from this layout."""
        for f in fields(self):
            ours_v, theirs_v = getattr(self, f.name), getattr(theirs, f.name)
            if ours_v != theirs_v:
                raise LayoutMismatch(f.name, ours_v, theirs_v)
