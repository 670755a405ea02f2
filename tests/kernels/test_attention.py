"""Paged decode / prefill attention: torch reference vs dense attention, Triton and C++ vs reference."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from kernels import VarlenLayout, cpu_features, paged_decode_attention, paged_prefill_attention
from kernels.attention import paged_decode_attention_ref, paged_prefill_attention_ref
from kernels.dispatch import forced
from tests.kernels.conftest import DEVICE
from tests.kernels.paged import PagedKV, cu_seqlens, dense_causal_attention, make_paged, rel_error

# (block_size, num_kv_heads, group = Hq // Hkv, head_dim): page sizes 16 and 5, GQA
# ratios 1/2/3/4, head dims 64/80/128 (any head dim works; the kernel pads to a power of two).
CASES = [(16, 2, 1, 64), (5, 2, 2, 80), (16, 1, 4, 128), (5, 1, 3, 64)]
# (kv length incl. new tokens, new tokens) per sequence.
DECODE = [(7, 1), (33, 1), (1, 1), (20, 1)]
# A whole prompt, a chunk after a cached prefix, a decode token and a short prompt.
MIXED = [(23, 23), (40, 9), (17, 1), (6, 6)]
PREFILL_ONLY = [(23, 23), (40, 9), (6, 6)]
F32_TOL = 1e-5
BF16_TOL = 2**-8  # one bfloat16 rounding of the output, relative to its largest value
Case = tuple[int, int, int, int]


def _inputs(
    case: Case, seqs: list[tuple[int, int]], seed: int, unused: float = 1.0e4
) -> tuple[PagedKV, torch.Tensor, torch.Tensor, float]:
    """The paged KV of ``seqs``, their new tokens' queries ``[T, Hq, D]``, cu_seqlens_q, scale."""
    block_size, num_kv_heads, group, head_dim = case
    paged = make_paged([n for n, _ in seqs], block_size, num_kv_heads, head_dim, torch.float32, seed, unused)
    q_lens = [m for _, m in seqs]
    q = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, device=DEVICE)
    return paged, q, cu_seqlens(q_lens), head_dim**-0.5


def _assert_matches_dense(
    out: torch.Tensor, q: torch.Tensor, cu: torch.Tensor, paged: PagedKV, scale: float
) -> None:
    assert out.shape == q.shape and out.dtype == q.dtype
    for b in range(cu.numel() - 1):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        expected = dense_causal_attention(q[rows], paged.keys[b], paged.values[b], scale)
        assert rel_error(out[rows], expected) < F32_TOL


@pytest.mark.parametrize("case", CASES)
def test_decode_reference_matches_dense_attention(case: Case) -> None:
    paged, q, cu, scale = _inputs(case, DECODE, seed=10)
    out = paged_decode_attention_ref(
        q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, scale
    )
    _assert_matches_dense(out, q, cu, paged, scale)


@pytest.mark.usefixtures("force_cpp")
@pytest.mark.parametrize(
    "case", [(16, 3, 3, 64), (16, 2, 4, 128), (12, 2, 1, 32), (5, 1, 8, 64), (16, 4, 2, 64), (32, 2, 3, 64)]
)
def test_bfloat16_dot_kernel_matches_the_generic_kernel(bf16_cpp: ModuleType, case: Case) -> None:
    # the AVX512-BF16 decode kernel (head dims 32/64/128, blocks up to 16 rows; block 32 runs the
    # generic one) against the generic bfloat16 kernel and the float32 reference: many blocks, a
    # partial last block, unused slots poisoned with NaN (never read), a strided query view
    cpp = bf16_cpp
    block_size, num_kv_heads, group, head_dim = case
    seqs = [1, 7, 16, 17, 300, 1050]
    paged = make_paged(seqs, block_size, num_kv_heads, head_dim, torch.bfloat16, seed=23, unused=float("nan"))
    fused = torch.randn(len(seqs), 2 * num_kv_heads * group, head_dim).to(torch.bfloat16)
    q = fused[:, : num_kv_heads * group]
    tables, scale = (paged.block_tables, paged.seq_lens), head_dim**-0.5
    fast = cpp.paged_decode_attention(q, paged.k_cache, paged.v_cache, *tables, scale, bf16_dot=True)
    generic = cpp.paged_decode_attention(q, paged.k_cache, paged.v_cache, *tables, scale, bf16_dot=False)
    k32, v32 = (c.float() for c in paged.finite_caches())
    expected = paged_decode_attention_ref(q.float(), k32, v32, *tables, scale)
    # Each kernel within one bfloat16 rounding of the float32 reference. Not of each other: the fast
    # kernel rounds its probabilities to bfloat16 for vdpbf16ps, the generic one keeps them in
    # float32, so the two outputs can sit on either side of the reference (up to two roundings apart)
    assert fast.dtype == torch.bfloat16 and rel_error(fast, expected) < BF16_TOL
    assert generic.dtype == torch.bfloat16 and rel_error(generic, expected) < BF16_TOL


@pytest.mark.parametrize("seqs", [MIXED, PREFILL_ONLY], ids=["mixed", "prefill_only"])
@pytest.mark.parametrize("case", CASES)
def test_prefill_reference_matches_dense_attention(case: Case, seqs: list[tuple[int, int]]) -> None:
    paged, q, cu, scale = _inputs(case, seqs, seed=11)
    out = paged_prefill_attention_ref(
        q, paged.k_cache, paged.v_cache, paged.block_tables, cu, paged.seq_lens, scale
    )
    _assert_matches_dense(out, q, cu, paged, scale)


# The Triton tests poison unused cache slots with NaN: the kernel must never read them.


@pytest.mark.usefixtures("force_triton")
@pytest.mark.parametrize("case", CASES)
def test_decode_triton_matches_reference(case: Case) -> None:
    paged, q, _, scale = _inputs(case, DECODE, seed=12, unused=float("nan"))
    tables = (paged.block_tables, paged.seq_lens)
    out = paged_decode_attention(q, paged.k_cache, paged.v_cache, *tables, scale)
    expected = paged_decode_attention_ref(q, *paged.finite_caches(), *tables, scale)
    assert rel_error(out, expected) < F32_TOL


@pytest.mark.usefixtures("force_triton")
@pytest.mark.parametrize("case", CASES)
def test_prefill_triton_matches_reference(case: Case) -> None:
    paged, q, cu, scale = _inputs(case, MIXED, seed=13, unused=float("nan"))
    tables = (paged.block_tables, cu, paged.seq_lens)
    out = paged_prefill_attention(q, paged.k_cache, paged.v_cache, *tables, scale)
    expected = paged_prefill_attention_ref(q, *paged.finite_caches(), *tables, scale)
    assert rel_error(out, expected) < F32_TOL


@pytest.mark.usefixtures("force_cpp")
@pytest.mark.parametrize("case", [*CASES, (16, 4, 2, 16), (12, 2, 8, 32), (5, 2, 3, 80)])
def test_decode_cpp_matches_reference(case: Case) -> None:
    # long sequences (many blocks, a partial last block); queries as a strided view of a fused
    # projection; unused slots poisoned: the C++ kernel, like Triton, never computes with them (its
    # prefetches may touch them). Block 12: scores in runs of 8 then 4; group 8: two passes of 4 heads
    seqs = [*DECODE, (300, 1), (47, 1)]
    paged, q, _, scale = _inputs(case, seqs, seed=16, unused=float("nan"))
    fused = torch.cat([q, torch.randn_like(q)], dim=1)
    q_view = fused[:, : q.shape[1]]
    tables = (paged.block_tables, paged.seq_lens)
    out = paged_decode_attention(q_view, paged.k_cache, paged.v_cache, *tables, scale)
    expected = paged_decode_attention_ref(q, *paged.finite_caches(), *tables, scale)
    assert rel_error(out, expected) < F32_TOL


@pytest.mark.usefixtures("force_cpp")
@pytest.mark.parametrize("case", [CASES[0], CASES[3], (16, 3, 3, 64), (5, 2, 3, 80)])
def test_bfloat16_cpp_matches_float32_reference(case: Case) -> None:
    # a bfloat16 model's decode steps (16, 3, 3, 64: SmolLM2's heads), alone and as the decode rows
    # of a mixed batch beside a prompt chunk: float32 math, so one bfloat16 rounding of the output
    block_size, num_kv_heads, group, head_dim = case
    seqs = [*DECODE, (300, 1), (70, 21)]
    paged = make_paged([n for n, _ in seqs], block_size, num_kv_heads, head_dim, torch.bfloat16, seed=17)
    q = torch.randn(len(seqs) + 20, num_kv_heads * group, head_dim).to(torch.bfloat16)
    cu, scale = cu_seqlens([m for _, m in seqs]), head_dim**-0.5
    tables = (paged.block_tables, paged.seq_lens)
    k32, v32 = paged.k_cache.float(), paged.v_cache.float()
    decode_rows = slice(0, len(seqs) - 1)
    decode_tables = (paged.block_tables[decode_rows], paged.seq_lens[decode_rows])
    out = paged_decode_attention(q[decode_rows], paged.k_cache, paged.v_cache, *decode_tables, scale)
    expected = paged_decode_attention_ref(q[decode_rows].float(), k32, v32, *decode_tables, scale)
    assert out.dtype == torch.bfloat16 and rel_error(out, expected) < BF16_TOL
    mixed = paged_prefill_attention(q, paged.k_cache, paged.v_cache, tables[0], cu, tables[1], scale)
    expected = paged_prefill_attention_ref(q.float(), k32, v32, tables[0], cu, tables[1], scale)
    assert mixed.dtype == torch.bfloat16 and rel_error(mixed, expected) < BF16_TOL


@pytest.mark.parametrize("seqs", [MIXED, PREFILL_ONLY], ids=["mixed", "prefill_only"])
@pytest.mark.parametrize("case", CASES)
def test_cpu_prefill_matches_dense_attention(case: Case, seqs: list[tuple[int, int]]) -> None:
    # the CPU forward path (one SDPA per prompt chunk, causal without a mask when nothing is cached)
    paged, q, cu, scale = _inputs(case, seqs, seed=18)
    with forced("torch"):
        out = paged_prefill_attention(
            q, paged.k_cache, paged.v_cache, paged.block_tables, cu, paged.seq_lens, scale
        )
    _assert_matches_dense(out, q, cu, paged, scale)


@pytest.mark.parametrize("seqs", [MIXED, [(17, 1), (33, 1), (40, 9), (23, 23)]], ids=["indexed", "sliced"])
@pytest.mark.parametrize("case", CASES)
def test_step_layout_from_host_lists_matches_dense_attention(case: Case, seqs: list[tuple[int, int]]) -> None:
    # the model runner's path: the layout built once from host lists (decode rows leading: one
    # slice; anywhere else: indexed), then read by the layer's attention without a sync
    paged, q, cu, scale = _inputs(case, seqs, seed=20)
    q_lens, seq_lens = [m for _, m in seqs], [n for n, _ in seqs]
    layout = VarlenLayout.build(q_lens, seq_lens, paged.block_tables, case[0])
    assert layout.num_decodes == q_lens.count(1) and layout.max_query_len == max(q_lens)
    assert isinstance(layout.decode_rows, slice) == (seqs[0][1] == 1)
    with forced("torch"):
        out = paged_prefill_attention(
            q, paged.k_cache, paged.v_cache, paged.block_tables, cu, paged.seq_lens, scale, layout
        )
    _assert_matches_dense(out, q, cu, paged, scale)


def test_bfloat16_cpu_prefill_matches_float32_reference() -> None:
    # SmolLM2's heads: a whole 300-token prompt, a 128-token chunk after 912 cached tokens and a
    # decode row, in bfloat16 (GEMMs in bf16, scores and softmax in float32): one bf16 rounding
    seqs = [(300, 300), (1040, 128), (65, 1)]
    paged = make_paged([n for n, _ in seqs], 16, 3, 64, torch.bfloat16, seed=19)
    q = torch.randn(sum(m for _, m in seqs), 9, 64).to(torch.bfloat16)
    cu, scale = cu_seqlens([m for _, m in seqs]), 64**-0.5
    tables = (paged.block_tables, cu, paged.seq_lens)
    with forced("torch"):
        out = paged_prefill_attention(q, paged.k_cache, paged.v_cache, *tables, scale)
    k32, v32 = paged.k_cache.float(), paged.v_cache.float()
    expected = paged_prefill_attention_ref(q.float(), k32, v32, *tables, scale)
    assert out.dtype == torch.bfloat16 and rel_error(out, expected) < BF16_TOL


@pytest.mark.parametrize(
    "case", [(16, 3, 3, 64), (16, 2, 1, 32), (5, 1, 4, 128), (8, 2, 8, 256), (16, 4, 2, 96), (32, 1, 5, 64)]
)
def test_bfloat16_prompt_kernel_matches_float32_reference(
    bf16_cpp: ModuleType, case: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the AVX512-BF16 prompt kernel (vdpbf16ps scores and value sums, probabilities rounded to
    # bfloat16): whole prompts from 2 tokens to several 64-key steps, chunks after cached prefixes
    # (ending inside a step and on its edge), row tiles of every width, a strided query view, beside
    # a decode row; unused cache slots poisoned with NaN (never read). Through the dispatch, which
    # must pick it on a CPU without AMX tiles: the same bits as the kernel called alone
    monkeypatch.setattr(cpu_features, "has_amx_bf16", lambda: False)
    cpp = bf16_cpp
    block_size, num_kv_heads, group, head_dim = case
    seqs = [(2, 2), (7, 7), (64, 64), (65, 65), (200, 200), (130, 1), (300, 37), (129, 128), (192, 64)]
    paged = make_paged(
        [n for n, _ in seqs], block_size, num_kv_heads, head_dim, torch.bfloat16, 24, float("nan")
    )
    num_tokens = sum(m for _, m in seqs)
    fused = torch.randn(num_tokens, 2 * num_kv_heads * group, head_dim).to(torch.bfloat16)
    q = fused[:, : num_kv_heads * group]
    cu, scale = cu_seqlens([m for _, m in seqs]), head_dim**-0.5
    tables = (paged.block_tables, cu, paged.seq_lens)
    with forced("cpp"):
        out = paged_prefill_attention(q, paged.k_cache, paged.v_cache, *tables, scale)
    k32, v32 = (c.float() for c in paged.finite_caches())
    expected = paged_prefill_attention_ref(q.float(), k32, v32, *tables, scale)
    assert out.dtype == torch.bfloat16 and rel_error(out, expected) < BF16_TOL
    for b, (n, m) in enumerate(seqs):
        if m > 1:
            rows = slice(int(cu[b]), int(cu[b + 1]))
            blocks = paged.block_tables[b, : -(-n // block_size)]
            alone = cpp.prefill_attention_bf16(q[rows], paged.k_cache, paged.v_cache, blocks, n, scale)
            assert torch.equal(out[rows], alone)


def test_bfloat16_prompts_go_to_torch_flash_attention_where_the_cpu_has_amx_tiles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # with AMX, torch's CPU flash attention (GEMMs on the tiles) beats the AVX512-BF16 kernel: the
    # dispatch must give prompt chunks the same bits as the torch path
    monkeypatch.setattr(cpu_features, "has_amx_bf16", lambda: True)
    seqs = [(300, 300), (1040, 128)]
    paged = make_paged([n for n, _ in seqs], 16, 3, 64, torch.bfloat16, seed=26)
    q = torch.randn(sum(m for _, m in seqs), 9, 64).to(torch.bfloat16)
    tables = (paged.block_tables, cu_seqlens([m for _, m in seqs]), paged.seq_lens)
    out = paged_prefill_attention(q, paged.k_cache, paged.v_cache, *tables, 64**-0.5)
    with forced("torch"):
        assert torch.equal(out, paged_prefill_attention(q, paged.k_cache, paged.v_cache, *tables, 64**-0.5))


def test_bfloat16_prompt_kernel_refuses_what_it_cannot_serve(bf16_cpp: ModuleType) -> None:
    cpp = bf16_cpp
    paged = make_paged([40], 16, 1, 64, torch.bfloat16, seed=25)
    q, blocks = torch.randn(8, 2, 64).to(torch.bfloat16), paged.block_tables[0, :3]
    k, v = paged.k_cache, paged.v_cache
    with pytest.raises(RuntimeError, match="bfloat16"):
        cpp.prefill_attention_bf16(q.float(), k, v, blocks, 40, 0.125)
    with pytest.raises(RuntimeError, match="blocks hold fewer than 49 tokens"):
        cpp.prefill_attention_bf16(q, k, v, blocks, 49, 0.125)
    with pytest.raises(RuntimeError, match="8 new tokens of a 5-token sequence"):
        cpp.prefill_attention_bf16(q, k, v, blocks, 5, 0.125)
    odd = make_paged([40], 16, 1, 48, torch.bfloat16, seed=25)
    with pytest.raises(RuntimeError, match="head dim a multiple of 32"):
        cpp.prefill_attention_bf16(q[..., :48], odd.k_cache, odd.v_cache, blocks, 40, 0.125)


@pytest.mark.usefixtures("backend")
def test_prefill_of_single_tokens_equals_decode() -> None:
    paged, q, cu, scale = _inputs(CASES[1], DECODE, seed=14)
    decode = paged_decode_attention(
        q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, scale
    )
    prefill = paged_prefill_attention(
        q, paged.k_cache, paged.v_cache, paged.block_tables, cu, paged.seq_lens, scale
    )
    assert rel_error(prefill, decode) < F32_TOL


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_triton_matches_float32_reference(dtype: torch.dtype) -> None:
    block_size, num_kv_heads, group, head_dim = 16, 4, 2, 128
    seqs = [(700, 700), (1500, 37), (901, 1), (64, 64)]
    paged = make_paged([n for n, _ in seqs], block_size, num_kv_heads, head_dim, dtype, seed=15)
    q = torch.randn(sum(m for _, m in seqs), num_kv_heads * group, head_dim, device=DEVICE, dtype=dtype)
    cu = cu_seqlens([m for _, m in seqs])
    k_cache, v_cache = paged.k_cache, paged.v_cache
    out = paged_prefill_attention(q, k_cache, v_cache, paged.block_tables, cu, paged.seq_lens, head_dim**-0.5)
    expected = paged_prefill_attention_ref(
        q.float(),
        k_cache.float(),
        v_cache.float(),
        paged.block_tables,
        cu,
        paged.seq_lens,
        head_dim**-0.5,
    )
    assert out.dtype == dtype
    assert rel_error(out, expected) < 2e-2
