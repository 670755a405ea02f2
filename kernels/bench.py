"""Times each Triton kernel against its torch reference: ``python -m kernels.bench``.

Needs CUDA; without it, says so and exits 0. Prints one row per kernel: the
milliseconds of each backend, the speed-up, and the largest difference between
their outputs relative to the reference's largest magnitude. Exits 1 when a
difference exceeds ``TOLERANCE`` for the dtype. ``--json PATH`` also writes the rows.
``--device cpu --shape tiny`` (with ``TRITON_INTERPRET=1``) runs the same code at toy
sizes on the CPU, Triton interpreted (what ``make gpu-check``'s dry run does).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from kernels import (
    VarlenLayout,
    gather_blocks,
    paged_decode_attention,
    paged_prefill_attention,
    scatter_blocks,
    write_kv_slots,
)
from kernels.dispatch import Backend, forced


@dataclass(frozen=True)
class BenchShape:
    """Cache geometry and batch sizes of one benchmark run."""

    num_layers: int = 32
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    num_blocks: int = 2048
    moved_blocks: int = 512  # gather/scatter
    decode_seqs: int = 64
    max_context: int = 4096  # decode lengths are drawn from [1, max_context]
    prefill_chunks: tuple[int, ...] = (1536, 512, 512)  # new tokens per prefill sequence
    prefill_context: int = 512  # cached prefix before each chunk
    mixed_decodes: int = 30  # decode tokens batched with the prefill chunks
    dtype: torch.dtype = torch.bfloat16


# toy sizes: the tests and the CPU dry run of `make gpu-check`
TINY = BenchShape(
    num_layers=2,
    num_q_heads=4,
    num_kv_heads=2,
    head_dim=16,
    block_size=4,
    num_blocks=24,
    moved_blocks=5,
    decode_seqs=3,
    max_context=30,
    prefill_chunks=(9, 4),
    prefill_context=6,
    mixed_decodes=2,
    dtype=torch.float32,
)
# largest relative difference from the torch reference accepted per dtype (bf16: ~2 ulp of the largest
# magnitude, the attention kernels round once more than the reference's float32 softmax)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


@dataclass(frozen=True)
class Row:
    name: str
    triton_ms: float
    torch_ms: float
    rel_diff: float


def _time_ms(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn))
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


@dataclass(frozen=True)
class Case:
    """``run`` is what gets timed; ``result`` reads back what it produced."""

    name: str
    run: Callable[[], object]
    result: Callable[[], torch.Tensor]


def _compare(case: Case, device: torch.device) -> Row:
    times: dict[Backend, float] = {}
    outs: dict[Backend, torch.Tensor] = {}
    for backend in ("triton", "torch"):
        with forced(backend):
            case.run()
            outs[backend] = case.result().clone()
            times[backend] = _time_ms(case.run, device)
    ref = outs["torch"].float()
    diff = (outs["triton"].float() - ref).abs().max() / ref.abs().max().clamp(min=1e-30)
    return Row(case.name, times["triton"], times["torch"], float(diff))


def _tables(lens: list[int], s: BenchShape, g: torch.Generator) -> torch.Tensor:
    """Random block ids per sequence, ``[len(lens), max blocks]`` int32 (distinct while they last)."""
    width = max(-(-n // s.block_size) for n in lens)
    count = len(lens) * width
    if count <= s.num_blocks:
        ids = torch.randperm(s.num_blocks, generator=g, device=g.device)[:count]
    else:
        ids = torch.randint(0, s.num_blocks, (count,), generator=g, device=g.device)
    return ids.view(len(lens), width).int()


def measure(s: BenchShape, device: torch.device) -> list[Row]:
    """Runs every kernel on both backends; needs CUDA, or ``TRITON_INTERPRET=1`` on CPU."""
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g, device=device).to(s.dtype)

    kv_cache = randn(s.num_blocks, s.num_layers, 2, s.block_size, s.num_kv_heads, s.head_dim)
    k_cache, v_cache = kv_cache[:, 0, 0], kv_cache[:, 0, 1]
    ids = torch.randperm(s.num_blocks, generator=g, device=device)[: s.moved_blocks]
    staging = gather_blocks(kv_cache, ids)
    incoming = randn(*staging.shape)
    tokens = s.num_blocks * s.block_size // 2
    new_kv = randn(tokens, s.num_kv_heads, s.head_dim)
    slots = torch.randperm(s.num_blocks * s.block_size, generator=g, device=device)[:tokens]
    dec_lens = torch.randint(1, s.max_context + 1, (s.decode_seqs,), generator=g, device=device).tolist()
    dec_q = randn(s.decode_seqs, s.num_q_heads, s.head_dim)
    dec_tables = _tables(dec_lens, s, g)
    dec_seq_lens = torch.tensor(dec_lens, dtype=torch.int32, device=device)
    q_lens = [*s.prefill_chunks, *([1] * s.mixed_decodes)]
    mix_lens = [s.prefill_context + n for n in s.prefill_chunks] + dec_lens[: s.mixed_decodes]
    mix_q = randn(sum(q_lens), s.num_q_heads, s.head_dim)
    mix_tables = _tables(mix_lens, s, g)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    mix_seq_lens = torch.tensor(mix_lens, dtype=torch.int32, device=device)
    scale = s.head_dim**-0.5
    mix_layout = VarlenLayout.build(q_lens, mix_lens, mix_tables, s.block_size)

    def decode() -> torch.Tensor:
        return paged_decode_attention(dec_q, k_cache, v_cache, dec_tables, dec_seq_lens, scale)

    def mixed() -> torch.Tensor:
        return paged_prefill_attention(
            mix_q, k_cache, v_cache, mix_tables, cu, mix_seq_lens, scale, mix_layout
        )

    cases = [
        Case(
            f"gather_blocks x{s.moved_blocks}",
            lambda: gather_blocks(kv_cache, ids, out=staging),
            lambda: staging,
        ),
        Case(
            f"scatter_blocks x{s.moved_blocks}",
            lambda: scatter_blocks(kv_cache, ids, incoming),
            lambda: gather_blocks(kv_cache, ids),
        ),
        Case(
            f"write_kv_slots T={tokens}",
            lambda: write_kv_slots(new_kv, new_kv, k_cache, v_cache, slots),
            lambda: k_cache[slots // s.block_size, slots % s.block_size],
        ),
        Case(f"decode B={s.decode_seqs}", decode, decode),
        Case(f"prefill+decode T={sum(q_lens)}", mixed, mixed),
    ]
    return [_compare(case, device) for case in cases]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument(
        "--device", default="cuda", help="cuda, or cpu (Triton interpreted: TRITON_INTERPRET=1)"
    )
    parser.add_argument("--shape", choices=["full", "tiny"], default="full", help="tiny: toy sizes")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here (JSON list)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("kernels.bench: no CUDA device; nothing to time.")
        return 0
    dtype = getattr(torch, args.dtype)
    shape = BenchShape(dtype=dtype) if args.shape == "full" else replace(TINY, dtype=dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}  {shape}")
    print(f"{'kernel':<28}{'triton ms':>12}{'torch ms':>12}{'speed-up':>10}{'rel diff':>11}")
    rows = measure(shape, device)
    for row in rows:
        speedup = row.torch_ms / row.triton_ms
        print(
            f"{row.name:<28}{row.triton_ms:>12.3f}{row.torch_ms:>12.3f}{speedup:>9.1f}x{row.rel_diff:>11.1e}"
        )
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows]))
    off = [r.name for r in rows if not r.rel_diff <= TOLERANCE[dtype]]
    if off:
        print(
            f"kernels.bench: {', '.join(off)} differ from the torch reference by more than {TOLERANCE[dtype]}"
        )
    return 1 if off else 0


if __name__ == "__main__":
    raise SystemExit(main())
