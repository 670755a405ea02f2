"""The fused elementwise steps: C++ CPU kernels against their torch references (Hugging Face's
order of operations), on odd widths and strided inputs as the model produces them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import kernels
from kernels.dispatch import cpu_kernels
from kernels.fused import _rotate_half, rms_norm_ref
from tests.kernels.paged import rel_error

TOL = 2e-6
WIDTHS = [512, 37, 8]


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.usefixtures("force_cpp")
@pytest.mark.parametrize("width", WIDTHS)
def test_rms_norm_matches_reference(width: int) -> None:
    x, w = _randn(33, width, seed=1) * 3, _randn(width, seed=2)
    strided = torch.cat([x, x], dim=1)[:, :width]  # rows at a stride of 2 * width
    for inp in (x, strided):
        assert rel_error(kernels.rms_norm(inp, w, 1e-6), rms_norm_ref(x, w, 1e-6)) < TOL


@pytest.mark.usefixtures("force_cpp")
@pytest.mark.parametrize("width", WIDTHS)
def test_add_rms_norm_returns_the_norm_of_the_sum_and_the_sum(width: int) -> None:
    x, residual, w = _randn(17, width, seed=3), _randn(17, width, seed=4), _randn(width, seed=5)
    before = (x.clone(), residual.clone())
    normed, summed = kernels.add_rms_norm(x, residual, w, 1e-5)
    assert torch.equal(summed, residual + x)
    assert rel_error(normed, rms_norm_ref(residual + x, w, 1e-5)) < TOL
    assert torch.equal(x, before[0]) and torch.equal(residual, before[1])  # inputs never written


@pytest.mark.usefixtures("force_cpp")
@pytest.mark.parametrize("width", [1408, 13])
def test_silu_and_mul_matches_reference(width: int) -> None:
    gate_up = _randn(9, 2 * width, seed=6) * 4  # tails of the sigmoid included
    gate, up = gate_up.chunk(2, dim=-1)
    assert rel_error(kernels.silu_and_mul(gate_up), torch.nn.functional.silu(gate) * up) < TOL


@pytest.mark.usefixtures("force_cpp")
@pytest.mark.parametrize(("heads", "head_dim"), [(12, 64), (3, 8)])
def test_apply_rotary_matches_reference(heads: int, head_dim: int) -> None:
    tokens = 11
    qkv = _randn(tokens, heads + 2, head_dim, seed=7)
    x = qkv[:, :heads]  # a strided view of the fused projection, as the model passes it
    angles = _randn(tokens, head_dim // 2, seed=8)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    expected = x * cos[:, None] + _rotate_half(x) * sin[:, None]
    out = kernels.apply_rotary(x, cos, sin)
    assert out.shape == x.shape and rel_error(out, expected) < TOL


def test_cpu_kernels_can_be_switched_off() -> None:
    code = "import torch, kernels.dispatch as d, sys; sys.exit(d.cpu_kernels(torch.zeros(1)) is not None)"
    env = os.environ | {"SPLITSERVE_CPU_KERNELS": "0"}
    assert subprocess.run([sys.executable, "-c", code], env=env, check=False).returncode == 0


@pytest.mark.usefixtures("force_cpp")
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_bfloat16_kernels_round_where_the_reference_rounds(rows: int) -> None:
    """A bfloat16 model's elementwise steps (SmolLM2's widths) on the C++ kernels equal the torch
    references bit for bit: float32 math, rounded to bfloat16 where each torch op rounds (the
    residual sum; the normalized row before the weight; silu before the product; each rotary
    product, then their sum)."""
    bf16 = torch.bfloat16
    x, residual = (3 * _randn(rows, 576, seed=20 + rows)).to(bf16), _randn(rows, 576, seed=21).to(bf16)
    weight = (_randn(576, seed=22).abs() + 0.5).to(bf16)
    cpp = cpu_kernels(x)
    assert cpp is not None  # the model's calls take it (kernels.fused dispatches bfloat16 here)
    assert torch.equal(cpp.rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5))
    normed, summed = cpp.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, residual + x) and torch.equal(normed, rms_norm_ref(residual + x, weight, 1e-5))
    gate_up = (2 * _randn(rows, 2 * 1536, seed=23)).to(bf16)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(cpp.silu_and_mul(gate_up), torch.nn.functional.silu(gate) * up)
    qkv = _randn(rows, 12 + 3, 64, seed=24).to(bf16)
    q = qkv[:, :12].contiguous()
    cos, sin = _randn(rows, 64, seed=25).to(bf16), _randn(rows, 64, seed=26).to(bf16)
    expected = q * cos[:, None] + _rotate_half(q) * sin[:, None]
    assert torch.equal(cpp.apply_rotary(q, cos, sin), expected)
    assert torch.equal(kernels.apply_rotary(qkv[:, :12], cos, sin), expected)  # a strided view
