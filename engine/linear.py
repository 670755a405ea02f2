"""Linear layers whose weights are laid out once, at load, for the device's fastest GEMM.

bfloat16 weights on a CPU with AVX512-BF16 and no AMX tiles are packed for `kernels.gemm` (2.2x
oneDNN at one row, 1.5x at eight, 1.06x at prefill sizes; measured in its docstring; with AMX,
oneDNN runs on the tiles at 5-11x ours from 64 rows on). Otherwise, on a CPU
with AVX-512, the weight is reordered into oneDNN's blocked format and every call runs oneDNN's
GEMM on it. Measured on a 2-core AVX-512 EPYC, the 6-layer dim-512 shape's 25 GEMMs of
one decode step (float32): 3.2 vs 4.3 ms at batch 1, 6.4 vs 12.6 ms at batch 32, and faster at
prefill sizes too. On AVX2-only CPUs the reorder lost at batch 1, so there (and on CUDA) the
weight is stored transposed, `[in, out]` contiguous, which ran skinny decode GEMMs ~25% faster on
CPU than `F.linear` over the `[out, in]` weight and is neutral elsewhere.

A `Linear` owns its prepared weight; the caller's `[out, in]` tensor is not referenced after
`prepare`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from kernels import gemm


def onednn_packing_available(device: torch.device) -> bool:
    """Whether `Linear.prepare` reorders weights for oneDNN on `device` (CPU with AVX-512 only)."""
    return (
        device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and torch.backends.cpu.get_cpu_capability().startswith("AVX512")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class WeightLayout(Enum):
    """How a `Linear` holds its weight, and so which GEMM runs it."""

    BF16_TILES = "bf16-tiles"  # `kernels.gemm`'s packed `[out, in]`
    ONEDNN = "onednn"  # oneDNN-blocked `[out, in]`
    TRANSPOSED = "transposed"  # `[in, out]` contiguous, for torch's GEMM


@dataclass(frozen=True, slots=True)
class Linear:
    """`y = x @ W.T + b` for `x` `[tokens, in]`; `W` was `[out, in]` when prepared."""

    weight: torch.Tensor  # as `layout` says
    bias: torch.Tensor | None  # float32 for `BF16_TILES`, else the weight's dtype
    layout: WeightLayout

    @classmethod
    def prepare(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
        if gemm.bf16_gemm_preferred(weight):
            # the kernel adds the bias in float32: converted here once, not in every call
            bias32 = None if bias is None else bias.float()
            return cls(gemm.pack_bf16_weight(weight.contiguous()), bias32, WeightLayout.BF16_TILES)
        if onednn_packing_available(weight.device):
            return cls(
                torch.ops.mkldnn._reorder_linear_weight(weight.contiguous()), bias, WeightLayout.ONEDNN
            )
        return cls(weight.t().contiguous(), bias, WeightLayout.TRANSPOSED)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout is WeightLayout.BF16_TILES:
            return gemm.bf16_linear(x, self.weight, self.bias)
        if self.layout is WeightLayout.ONEDNN:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        if self.bias is not None:
            return torch.addmm(self.bias, x, self.weight)
        return x @ self.weight
