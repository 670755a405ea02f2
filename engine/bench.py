"""Decode micro-benchmark: `LLM.generate` vs transformers' `generate`, same checkpoint, same run.

    python -m engine.bench [--shape llama-6l-512] [--max-tokens 64] [--json PATH]

Both sides generate exactly `--max-tokens` tokens per request (EOS ignored), greedy, float32, at
batch 1 and at a mixed-length batch of 32. Decode tokens/s excludes the prompt: each side also runs
the same batch with 1 output token (prefill + first token), and decode tok/s =
batch * (max_tokens - 1) / (time(max_tokens) - time(1)). End-to-end tok/s (prefill included) is
reported beside it. The ratio we track is ours / transformers on decode tok/s.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass(slots=True)
class Timing:
    """Seconds for the same batch with 1 output token and with `max_tokens` output tokens."""

    batch: int
    max_tokens: int
    first_s: float
    full_s: float

    @property
    def decode_tok_s(self) -> float:
        return self.batch * (self.max_tokens - 1) / (self.full_s - self.first_s)

    @property
    def e2e_tok_s(self) -> float:
        return self.batch * self.max_tokens / self.full_s


@dataclass(slots=True)
class BenchRow:
    batch: int
    prompt_lens: str
    max_tokens: int
    ours_decode_tok_s: float
    hf_decode_tok_s: float
    ours_e2e_tok_s: float
    hf_e2e_tok_s: float

    @property
    def ratio(self) -> float:
        return self.ours_decode_tok_s / self.hf_decode_tok_s


def _prompts(batch: int, vocab: int, rng: random.Random) -> list[list[int]]:
    lengths = [32] if batch == 1 else [rng.randint(16, 256) for _ in range(batch)]
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _time_ours(llm: object, prompts: list[list[int]], max_tokens: int) -> float:
    """Seconds for `LLM.generate` to produce exactly `max_tokens` tokens per prompt."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)  # type: ignore[attr-defined]
    elapsed = time.perf_counter() - start
    assert all(len(o.token_ids) == max_tokens for o in outs)
    return elapsed


def _time_hf(model: torch.nn.Module, prompts: list[list[int]], max_tokens: int, pad_id: int = 0) -> float:
    """Seconds for transformers' batched `generate` (left-padded) to produce `max_tokens` tokens each."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(  # type: ignore[operator]
            ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            pad_token_id=pad_id,
        )
    elapsed = time.perf_counter() - start
    assert out.shape[1] == width + max_tokens
    return elapsed


def run_bench(
    model_dir: Path, max_tokens: int, batches: list[int], repeats: int = 3, seed: int = 0
) -> list[BenchRow]:
    from transformers import AutoModelForCausalLM

    from engine import LLM

    llm = LLM(model_dir, max_num_batched_tokens=2048, max_num_seqs=64, enable_prefix_caching=False)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    vocab = llm.engine.loaded.config.vocab_size
    rng = random.Random(seed)
    _time_ours(llm, _prompts(1, vocab, rng), 4)  # warm-up both
    _time_hf(hf, _prompts(1, vocab, rng), 4)
    rows = []
    for batch in batches:
        prompts = _prompts(batch, vocab, rng)
        lens = f"{min(map(len, prompts))}-{max(map(len, prompts))}"
        # interleave the two sides so that machine noise hits both alike; keep each side's best
        # (least disturbed) time of `repeats` runs
        ours = Timing(batch, max_tokens, math.inf, math.inf)
        theirs = Timing(batch, max_tokens, math.inf, math.inf)
        for _ in range(repeats):
            ours.first_s = min(ours.first_s, _time_ours(llm, prompts, 1))
            theirs.first_s = min(theirs.first_s, _time_hf(hf, prompts, 1))
            ours.full_s = min(ours.full_s, _time_ours(llm, prompts, max_tokens))
            theirs.full_s = min(theirs.full_s, _time_hf(hf, prompts, max_tokens))
        rows.append(
            BenchRow(
                batch,
                lens,
                max_tokens,
                ours.decode_tok_s,
                theirs.decode_tok_s,
                ours.e2e_tok_s,
                theirs.e2e_tok_s,
            )
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny:llama-6l-512", help="checkpoint dir or tiny:SHAPE")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--repeats", type=int, default=3, help="runs per point; the best is kept")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    from engine.model_dir import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    rows = run_bench(model_dir, args.max_tokens, [int(b) for b in args.batches.split(",")], args.repeats)
    print(f"model {args.model}  torch threads {torch.get_num_threads()}  max_tokens {args.max_tokens}")
    print(
        f"{'batch':>5} {'prompt lens':>12} {'decode tok/s: ours':>19} {'hf':>8} {'ratio':>6}"
        f" {'e2e tok/s: ours':>16} {'hf':>8}"
    )
    for r in rows:
        print(
            f"{r.batch:>5} {r.prompt_lens:>12} {r.ours_decode_tok_s:>19.1f} {r.hf_decode_tok_s:>8.1f}"
            f" {r.ratio:>6.2f} {r.ours_e2e_tok_s:>16.1f} {r.hf_e2e_tok_s:>8.1f}"
        )
    if args.json:
        args.json.write_text("".join(json.dumps(asdict(r) | {"ratio": r.ratio}) + "\n" for r in rows))


if __name__ == "__main__":
    main()
