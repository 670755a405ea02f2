"""Times one model step's GEMMs at M rows: `engine.linear.Linear` on `kernels.gemm`'s packed weight
against the same class on oneDNN's blocked weight (what `Linear.prepare` picks where the CPU has
AMX tiles), same weights, interleaved rounds, one process:

    taskset -c 1 python -m kernels.gemm_bench --rows 1,2,4,8,16,32,64,256 [--threads 1]

The default shape is SmolLM2-135M's (30 layers of qkv 960x576, o 576x576, gate_up 3072x576, down
576x1536; 212 MB of bfloat16 weights, beyond any last-level cache); the lm_head is left out (a
step applies it to the sampled rows only). Prints, per M, the best of `--rounds` of each side in
milliseconds and their ratio. Needs a CPU with AVX512-BF16 and oneDNN.
"""

from __future__ import annotations

import argparse
import time

import torch

from engine.linear import Linear, WeightLayout, onednn_packing_available
from kernels import gemm

SMOLLM2_LAYER = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in) of each GEMM of a layer


def _step_ms(calls: list[tuple[Linear, torch.Tensor]]) -> float:
    start = time.perf_counter()
    for linear, x in calls:
        linear(x)
    return (time.perf_counter() - start) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,256", help="comma-separated M values")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    weights = [torch.randn(o, i).mul_(0.05).bfloat16() for _ in range(args.layers) for o, i in SMOLLM2_LAYER]
    if not (gemm.bf16_gemm_available(weights[0]) and onednn_packing_available(weights[0].device)):
        parser.error("needs a CPU with AVX512-BF16, the C++ kernels and oneDNN")
    ours = [Linear(gemm.pack_bf16_weight(w), None, WeightLayout.BF16_TILES) for w in weights]
    onednn = [Linear(torch.ops.mkldnn._reorder_linear_weight(w), None, WeightLayout.ONEDNN) for w in weights]
    print(f"{'rows':>6} {'oneDNN ms':>10} {'ours ms':>9} {'speed-up':>9}")
    for m in (int(v) for v in args.rows.split(",")):
        inputs = {k: torch.randn(m, k).bfloat16() for k in {w.shape[1] for w in weights}}
        best = {"onednn": float("inf"), "ours": float("inf")}
        for _ in range(args.rounds):  # interleaved: drift on a shared box hits both sides alike
            for name, fns in (("onednn", onednn), ("ours", ours)):
                calls = [(fn, inputs[w.shape[1]]) for fn, w in zip(fns, weights, strict=True)]
                best[name] = min(best[name], _step_ms(calls))
        print(f"{m:>6} {best['onednn']:>10.2f} {best['ours']:>9.2f} {best['onednn'] / best['ours']:>8.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
