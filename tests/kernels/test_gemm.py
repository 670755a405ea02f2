"""The bfloat16 GEMM (``kernels.gemm``, AVX512-BF16 CPUs) against float32 matmul of the same values, and
the engine's `Linear` choosing it."""

from __future__ import annotations

import pytest
import torch

from engine.linear import Linear, WeightLayout, onednn_packing_available
from kernels import cpu_features, gemm, gemm_bench

pytestmark = pytest.mark.usefixtures("bf16_cpp")


def bf16_step(v: torch.Tensor) -> torch.Tensor:
    """The spacing of bfloat16 values at each value's magnitude (8 significant bits)."""
    return torch.ldexp(torch.ones_like(v), torch.frexp(v).exponent - 8)


def bf16_ulps(got: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """How many bfloat16 steps (at the expected value's magnitude) each output is off."""
    return (got.float() - expected).abs() / bf16_step(expected)


def check(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    expected = x.float() @ w.float().t() + (0 if bias is None else bias.float())
    got = gemm.bf16_linear(x, gemm.pack_bf16_weight(w), bias)
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    # rounded once to the nearest bfloat16 (half a step), from float32 sums in another order than the
    # reference's (their error bounded by the magnitudes summed: it shows where the sum cancels)
    magnitudes = x.float().abs() @ w.float().abs().t()
    error = (got.float() - expected).abs() - 1e-5 * magnitudes
    assert (error <= 0.5 * bf16_step(expected)).all()
    assert (bf16_ulps(got, expected) <= 0.5).float().mean() > 0.99


# N: one tile of each tail width (16/32/48), whole tiles, whole tiles and a tail; K: one pair and more
@pytest.mark.parametrize("n,k", [(16, 2), (32, 10), (48, 64), (64, 96), (80, 130), (192, 576), (1040, 62)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float32_matmul(n: int, k: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16) if with_bias else None
    for m in (1, 2, 5, 6, 7, 8, 13, 37):  # one pass of up to six rows, then passes of six and the rest
        check(torch.randn(m, k, generator=gen).to(torch.bfloat16), w, bias)


def test_strided_rows_empty_input_and_an_owned_copy() -> None:
    w = torch.randn(64, 40).to(torch.bfloat16)
    x = torch.randn(3, 40).to(torch.bfloat16)
    packed = gemm.pack_bf16_weight(w)
    assert packed.shape == w.shape and packed.data_ptr() != w.data_ptr()
    before = gemm.bf16_linear(x, packed)
    w.zero_()  # the packed copy is the kernel's own
    assert before.abs().sum() > 0 and torch.equal(gemm.bf16_linear(x, packed), before)
    wide = torch.randn(4, 100).to(torch.bfloat16)
    w2 = torch.randn(32, 40).to(torch.bfloat16)
    check(wide[:, 10:50], w2, None)  # rows 100 apart
    check(wide.t().contiguous().t()[:, :40], w2, None)  # column-strided: copied first
    assert gemm.bf16_linear(torch.empty(0, 40, dtype=torch.bfloat16), packed).shape == (0, 64)


def test_shapes_and_dtypes_it_does_not_take() -> None:
    assert not gemm.bf16_gemm_available(torch.zeros(40, 64, dtype=torch.bfloat16))  # N % 16
    assert not gemm.bf16_gemm_available(torch.zeros(64, 63, dtype=torch.bfloat16))  # K odd
    assert not gemm.bf16_gemm_available(torch.zeros(64, 64))  # float32
    with pytest.raises(ValueError, match="no bfloat16 GEMM"):
        gemm.pack_bf16_weight(torch.zeros(40, 64, dtype=torch.bfloat16))
    packed = gemm.pack_bf16_weight(torch.zeros(64, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"x \[M, K\]"):
        gemm.bf16_linear(torch.zeros(2, 32, dtype=torch.bfloat16), packed)
    with pytest.raises(RuntimeError, match="bias of 64"):
        gemm.bf16_linear(
            torch.zeros(2, 64, dtype=torch.bfloat16), packed, torch.zeros(8, dtype=torch.bfloat16)
        )


def test_linear_packs_bfloat16_weights_and_keeps_float32_on_its_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_features, "has_amx_bf16", lambda: False)
    w = torch.randn(96, 64)
    bias = torch.randn(96)
    x = torch.randn(5, 64)
    fast = Linear.prepare(w.bfloat16(), bias.bfloat16())
    assert fast.layout is WeightLayout.BF16_TILES
    assert fast.bias is not None and fast.bias.dtype == torch.float32  # converted once, at load
    expected = x.bfloat16().float() @ w.bfloat16().float().t() + bias.bfloat16().float()
    assert bf16_ulps(fast(x.bfloat16()), expected).max() <= 1.0
    assert Linear.prepare(w).layout is not WeightLayout.BF16_TILES
    assert Linear.prepare(torch.randn(40, 64).bfloat16()).layout is not WeightLayout.BF16_TILES


@pytest.mark.skipif(not onednn_packing_available(torch.device("cpu")), reason="needs oneDNN on AVX-512")
def test_linear_leaves_bfloat16_to_onednn_where_the_cpu_has_amx_tiles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cpu_features, "has_amx_bf16", lambda: True)
    w, x = torch.randn(96, 64).bfloat16(), torch.randn(5, 64).bfloat16()
    linear = Linear.prepare(w)
    assert linear.layout is WeightLayout.ONEDNN
    assert bf16_ulps(linear(x), x.float() @ w.float().t()).max() <= 1.0


def test_the_benchmark_runs_both_sides(capsys: pytest.CaptureFixture[str]) -> None:
    assert gemm_bench.main(["--layers", "1", "--rows", "1,7", "--rounds", "1"]) == 0
    rows = capsys.readouterr().out.splitlines()[1:]
    assert [r.split()[0] for r in rows] == ["1", "7"] and all(r.endswith("x") for r in rows)
