"""The fused elementwise steps: C++ CPU kernels against their torch references (Hugging Face's
order of operations), on odd widths and strided inputs as the model produces them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import kernels
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
