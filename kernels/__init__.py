"""Device kernels: Triton kernels beside the torch reference each is tested against.

CUDA tensors run the Triton kernel; float32 CPU tensors run the C++ twin where there is one
(``kernels.cpu_ext``), other CPU tensors the torch reference (see ``kernels.dispatch``). The
decoder layer's elementwise steps are fused in ``kernels.fused``. Triton is imported only when a
Triton path runs.
"""

from __future__ import annotations

from kernels.attention import VarlenLayout, paged_decode_attention, paged_prefill_attention
from kernels.block_copy import gather_blocks, scatter_blocks
from kernels.fused import add_rms_norm, apply_rotary, rms_norm, silu_and_mul
from kernels.kv_write import write_kv_slots

__all__ = [
    "VarlenLayout",
    "add_rms_norm",
    "apply_rotary",
    "gather_blocks",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "scatter_blocks",
    "silu_and_mul",
    "write_kv_slots",
]
