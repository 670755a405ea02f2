"""The decoder layer's elementwise steps, fused: residual add + RMSNorm, RMSNorm, SiLU-and-mul, rotary.

Each function has a torch reference in Hugging Face's order of operations (what runs on CUDA and
on CPU tensors of other dtypes) and a float32 / bfloat16 CPU twin in ``kernels/csrc``
(``kernels.cpu_ext``) that makes one pass over memory where the reference runs five to eight torch
ops; in bfloat16 it rounds where the reference's ops round. Every function returns new tensors;
inputs are never written.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.dispatch import cpu_kernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x**2, -1) + eps)`` over the last dim."""
    if x.dim() == 2 and x.stride(1) == 1 and weight.dtype == x.dtype and (cpp := cpu_kernels(x)) is not None:
        return cpp.rms_norm(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` for ``[T, H]`` tensors."""
    same = weight.dtype == residual.dtype == x.dtype
    if same and x.stride(1) == 1 and residual.stride(1) == 1 and (cpp := cpu_kernels(x)) is not None:
        normed, summed = cpp.add_rms_norm(x, residual, weight, eps)
        return normed, summed
    summed = residual + x
    return rms_norm_ref(summed, weight, eps), summed


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` ``[T, 2I]`` holding gate then up."""
    if gate_up.stride(1) == 1 and (cpp := cpu_kernels(gate_up)) is not None:
        return cpp.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` for ``x`` ``[T, H, D]``, ``cos``/``sin`` ``[T, D]``."""
    dense_heads = x.stride(2) == 1 and x.stride(1) == x.shape[2]
    if dense_heads and cos.dtype == sin.dtype == x.dtype and (cpp := cpu_kernels(x)) is not None:
        return cpp.apply_rotary(x, cos.contiguous(), sin.contiguous())
    return x * cos.unsqueeze(1) + _rotate_half(x) * sin.unsqueeze(1)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, cast back, then scaled (Hugging Face's order of operations)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
