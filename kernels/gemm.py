"""bfloat16 GEMM on CPUs with AVX512-BF16: the weight packed once into 64-column tiles of VNNI pairs
(``kernels/csrc/cpu_gemm.cpp`` documents the layout), then ``y = x @ W.T + b`` by ``vdpbf16ps``.

Measured with ``python -m kernels.gemm_bench`` on a 2-core AVX-512 EPYC (Zen 4), one core: the
120 GEMMs of a SmolLM2-135M step (212 MB of weights) took 11.3 ms at 1 row against oneDNN's 25.0 on
its own blocked weight (2.2x; the weight read at 19 GB/s, near the 22 GB/s one core reads), 1.5x at 8
rows, 1.2x at 16 to 64 and 1.06-1.08x at 256 and 1,024. On a CPU with AMX tiles oneDNN uses them and
wins from two rows on (a 2-core Xeon, one core: 1.19x ours at one row, 0.94x at two, 0.20x at 64,
0.09x at 1,024), so there `bf16_gemm_preferred` is false and `engine.linear` keeps oneDNN.

``packed = pack_bf16_weight(W)`` owns a reordered copy of ``W`` (same shape, ``[N, K]``); the caller
may drop ``W``. Where ``bf16_gemm_available`` is false (another CPU, dtype, device or shape, or the
C++ kernels disabled) the caller keeps its own path.
"""

from __future__ import annotations

import torch

from kernels import cpu_features
from kernels.dispatch import cpu_kernels


def bf16_gemm_available(weight: torch.Tensor) -> bool:
    """Whether ``weight`` (``[N, K]``) can be packed for `bf16_linear` here: bfloat16 on a CPU with
    AVX512-BF16, N a multiple of 16, K even, the C++ kernels loaded."""
    if weight.dim() != 2 or weight.shape[0] % 16 or weight.shape[1] % 2:
        return False
    cpp = cpu_kernels(weight, (torch.bfloat16,))
    return cpp is not None and bool(cpp.has_bf16_dot())


def bf16_gemm_preferred(weight: torch.Tensor) -> bool:
    """Whether ``weight``'s layers should run `bf16_linear`: it is available and the CPU has no AMX
    tiles (where oneDNN's GEMM on them is several times faster at every row count but one)."""
    return bf16_gemm_available(weight) and not cpu_features.has_amx_bf16()


def pack_bf16_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[N, K]`` reordered into `bf16_linear`'s tiles (a new tensor of the same shape)."""
    cpp = cpu_kernels(weight, (torch.bfloat16,))
    if cpp is None or not bf16_gemm_available(weight):
        raise ValueError(
            f"no bfloat16 GEMM for a {weight.dtype} {tuple(weight.shape)} weight on {weight.device}"
        )
    packed: torch.Tensor = cpp.pack_bf16_weight(weight)
    return packed


def bf16_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for ``x`` ``[M, K]`` bfloat16 and ``packed = pack_bf16_weight(W)``: float32
    sums of the exact products, the bias added in float32 (a float32 bias is used as it is, any other
    is converted each call), rounded to bfloat16 once."""
    cpp = cpu_kernels(x, (torch.bfloat16,))
    if cpp is None:
        raise ValueError(f"bf16_linear: no C++ kernels for a {x.dtype} input on {x.device}")
    out: torch.Tensor = cpp.bf16_linear(x, packed, bias)
    return out
