"""Device kernels: Triton kernels beside the torch reference each is tested against.

CUDA tensors run the Triton kernel, CPU tensors the torch reference (see
``kernels.dispatch``). Triton is imported only when a Triton path runs.
"""

from __future__ import annotations

from kernels.attention import paged_decode_attention, paged_prefill_attention
from kernels.block_copy import gather_blocks, scatter_blocks
from kernels.kv_write import write_kv_slots

__all__ = [
    "gather_blocks",
    "paged_decode_attention",
    "paged_prefill_attention",
    "scatter_blocks",
    "write_kv_slots",
]
