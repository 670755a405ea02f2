"""Engine settings shared by the colocated engine, the prefill worker and the decode worker."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "bfloat16", "float16")  # torch dtype names; torch loads only for `torch_dtype`


@dataclass(slots=True)
class EngineConfig:
    """How one engine instance sizes its KV pool and its steps.

    `num_blocks` fixes the KV pool size; when None it is derived from `kv_cache_memory_bytes`.
    `max_num_batched_tokens` is the per-step token budget that chunked prefill and decode share.

    Role policy (set by the role that builds the engine, never changed after construction):
    `prefill_only` finishes a sequence after its first sample (its `finish_reason` is its stop reason,
    or None when decoding goes on elsewhere); `keep_blocks_on_finish` keeps a normally finished
    sequence's blocks until the owner calls `LLMEngine.release` (the prefill worker still ships them).
    Aborted and preempted sequences always release at once.
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_bytes: int = 256 << 20
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    dtype: str = "float32"
    device: str = "cpu"
    debug_integrity: bool = False
    prefill_only: bool = False
    keep_blocks_on_finish: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype
