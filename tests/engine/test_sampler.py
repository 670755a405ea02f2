"""The device sampler on CPU: exact cases, seeded reproducibility and empirical distributions."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from engine.sampler import Sampler, SamplingBatch, make_generator, penalize
from engine.sampling_params import SamplingParams

sampler = Sampler()
# chi-square critical values at p = 0.001 by degrees of freedom; every draw below is seeded, so a
# pass is deterministic, and a broken sampler misses these bounds by orders of magnitude.
CHI2_CRIT = {1: 10.83, 2: 13.82, 3: 16.27, 5: 20.52}


def build(
    params: Sequence[SamplingParams],
    vocab: int,
    *,
    outputs: Sequence[Sequence[int]] | None = None,
    prompts: Sequence[Sequence[int]] | None = None,
    eos: Sequence[int] = (),
    generators: Sequence[torch.Generator | None] | None = None,
) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(
        params,
        generators or [None] * n,
        prompts or [[]] * n,
        outputs or [[]] * n,
        eos_token_ids=eos,
        vocab_size=vocab,
        device="cpu",
    )


def sample_rows(logits: torch.Tensor, params: SamplingParams, rng_seed: int = 0) -> torch.Tensor:
    """One unseeded draw per row of `logits`, all rows sharing `params`, under a fixed global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(rng_seed)
        return sampler(logits, build([params] * logits.shape[0], logits.shape[1])).token_ids


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def test_greedy_is_argmax_with_raw_logprobs() -> None:
    logits = torch.randn(7, 33, generator=torch.Generator().manual_seed(1))
    out = sampler(logits, build([SamplingParams(temperature=0.0)] * 7, 33))
    assert torch.equal(out.token_ids, logits.argmax(-1))
    expected = logits.log_softmax(-1).gather(1, out.token_ids[:, None]).squeeze(1)
    torch.testing.assert_close(out.logprobs, expected)
    assert out.top_ids is None and out.top_logprobs is None


@pytest.mark.parametrize("seed", [None, 5])
@pytest.mark.parametrize("overrides", [{"top_k": 1}, {"top_p": 1e-6}], ids=["top_k=1", "top_p=tiny"])
def test_degenerate_filters_equal_greedy(overrides: dict[str, float], seed: int | None) -> None:
    logits = torch.randn(32, 50, generator=torch.Generator().manual_seed(2)) * 0.5
    params = SamplingParams(temperature=1.5, seed=seed, **overrides)  # type: ignore[arg-type]
    assert torch.equal(sample_rows(logits, params), logits.argmax(-1))


def run_steps(
    logits: torch.Tensor, target: SamplingParams, others: list[SamplingParams], position: int
) -> list[int]:
    """Sample `logits.shape[0]` steps of one request placed at `position` among `others` (all growing
    their outputs), and return the request's tokens."""
    steps, vocab = logits.shape
    params = [*others[:position], target, *others[position:]]
    generators = [make_generator(p.seed, "cpu") if p.seed is not None else None for p in params]
    outputs: list[list[int]] = [[] for _ in params]
    noise = torch.Generator().manual_seed(position + 100)
    for step in range(steps):
        batch_logits = torch.randn(len(params), vocab, generator=noise)
        batch_logits[position] = logits[step]
        batch = build(params, vocab, outputs=outputs, generators=generators)
        for out, tok in zip(outputs, sampler(batch_logits, batch).token_ids.tolist(), strict=True):
            out.append(tok)
    return outputs[position]


def test_seeded_request_is_reproducible_and_batch_invariant() -> None:
    steps, vocab = 12, 40
    flat = torch.zeros(steps, vocab)  # the same uniform logits every step: tokens come from noise alone
    target = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    others = [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0, seed=99),
        SamplingParams(temperature=0.0),
    ]
    alone = run_steps(flat, target, [], 0)
    assert alone == run_steps(flat, target, [], 0)
    assert alone == run_steps(flat, target, others, 0)
    assert alone == run_steps(flat, target, others, 2)
    assert alone == run_steps(flat, target, others[::-1], 3)
    assert len(set(alone)) > 1, "the noise must change from step to step"


def test_seeded_row_without_generator_matches_one_with() -> None:
    logits = torch.zeros(1, 1000)
    params = [SamplingParams(seed=7)]
    with_gen = sampler(logits, build(params, 1000, generators=[make_generator(0, "cpu")])).token_ids
    assert torch.equal(with_gen, sampler(logits, build(params, 1000)).token_ids)


def test_different_seeds_differ() -> None:
    flat = torch.zeros(20, 1000)
    first = run_steps(flat, SamplingParams(seed=1), [], 0)
    second = run_steps(flat, SamplingParams(seed=2), [], 0)
    assert first != second


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_unseeded_distribution_matches_softmax(temperature: float) -> None:
    base = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])
    tokens = sample_rows(base.expand(30000, -1), SamplingParams(temperature=temperature))
    assert chi_square(tokens, (base / temperature).softmax(-1)) < CHI2_CRIT[5]


def test_seeded_distribution_matches_softmax() -> None:
    base = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])
    params = [SamplingParams(seed=s) for s in range(4000)]
    tokens = sampler(base.expand(len(params), -1), build(params, 6)).token_ids
    assert chi_square(tokens, base.softmax(-1)) < CHI2_CRIT[5]


def test_top_k_never_samples_outside_top_k() -> None:
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(3))
    allowed = logits.topk(5, dim=-1).indices
    seen: set[int] = set()
    for draw in range(20):
        tokens = sample_rows(logits, SamplingParams(temperature=3.0, top_k=5), rng_seed=draw)
        assert bool((allowed == tokens[:, None]).any(-1).all())
        seen.update(tokens.tolist())
    assert len(seen) > 5, "top-k must still sample among the k tokens, not collapse to greedy"


def test_top_p_samples_the_renormalized_nucleus() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    # mass before token 2 is 0.8 > 0.7: the nucleus is {0, 1}, renormalized to 5/8 and 3/8
    tokens = sample_rows(probs.log().expand(20000, -1), SamplingParams(top_p=0.7))
    assert int(tokens.max()) <= 1
    assert chi_square(tokens, torch.tensor([0.625, 0.375, 0.0, 0.0])[:2]) < CHI2_CRIT[1]


def test_min_p_removes_tokens_below_threshold() -> None:
    probs = torch.tensor([0.5, 0.3, 0.12, 0.08])
    # threshold = 0.2 * 0.5 = 0.1: only token 3 goes
    tokens = sample_rows(probs.log().expand(20000, -1), SamplingParams(min_p=0.2))
    assert int(tokens.max()) <= 2
    assert chi_square(tokens, probs[:3] / probs[:3].sum()) < CHI2_CRIT[2]


def test_penalties_hand_computed() -> None:
    raw = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0]).expand(4, -1).clone()
    untouched = raw.clone()
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(temperature=0.0, repetition_penalty=2.0),
        SamplingParams(temperature=0.0),
    ]
    batch = build(params, 5, prompts=[[0]] * 4, outputs=[[1, 3, 3]] * 4)
    expected = torch.tensor(
        [
            # token 0: prompt only; 1: output once; 2: unseen; 3: output twice; 4: unseen
            [2.0 / 2, -1.0 * 2 - 0.5 - 0.25, 0.5, 3.0 / 2 - 0.5 - 2 * 0.25, -2.0],
            [2.0, -1.0 - 0.5 - 0.25, 0.5, 3.0 - 0.5 - 2 * 0.25, -2.0],
            [1.0, -2.0, 0.5, 1.5, -2.0],
            [2.0, -1.0, 0.5, 3.0, -2.0],
        ]
    )
    torch.testing.assert_close(penalize(raw, batch), expected)
    assert torch.equal(raw, untouched), "the caller's logits are never written"
    # greedy rows pick from penalized logits; row 1 ties tokens 0 and 3 at 2.0 (argmax takes the first)
    assert sampler(raw, batch).token_ids.tolist() == [0, 0, 3, 3]


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.tensor([[1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 4.0, 5.0]]).expand(4, -1)
    base = {"temperature": 0.0, "min_tokens": 3, "stop_token_ids": [8, 1000]}
    params = [
        SamplingParams(**base),  # type: ignore[arg-type]
        SamplingParams(**base),  # type: ignore[arg-type]
        SamplingParams(**base, ignore_eos=True),  # type: ignore[arg-type]
        SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[8], seed=3),
    ]
    outputs = [[5, 5], [5, 5, 5], [5, 5], [5]]
    out = sampler(logits, build(params, 10, outputs=outputs, eos=[9]))
    # row 0: EOS 9 and stop 8 suppressed; row 1: min_tokens reached; row 2: ignore_eos keeps EOS
    # (it ends nothing); row 3: sampled, so anything but 8 and 9
    assert out.token_ids.tolist()[:3] == [0, 9, 9]
    assert int(out.token_ids[3]) not in (8, 9)
    torch.testing.assert_close(out.logprobs[0], logits[0].log_softmax(-1)[0])


def test_logprobs_are_raw_and_top_n_sorted() -> None:
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(4))
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.8, top_k=10, repetition_penalty=1.5, logprobs=5, seed=11),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, min_p=0.1, logprobs=0),
        SamplingParams(temperature=0.5, top_p=0.5, frequency_penalty=1.0),
    ]
    out = sampler(logits, build(params, 30, prompts=[[1, 2]] * 5, outputs=[[3, 3, 4]] * 5))
    log_probs = logits.log_softmax(-1)
    torch.testing.assert_close(out.logprobs, log_probs.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.top_ids is not None and out.top_logprobs is not None
    assert out.top_ids.shape == (5, 5) and out.top_ids.dtype == torch.int64
    assert torch.equal(out.top_ids, log_probs.topk(5, dim=-1).indices)
    torch.testing.assert_close(out.top_logprobs, log_probs.gather(1, out.top_ids))
    assert bool((out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all())
    assert out.token_ids.dtype == torch.int64 and out.logprobs.dtype == torch.float32
    assert math.isfinite(float(out.logprobs.sum()))


def test_half_precision_logits_are_sampled_in_float32() -> None:
    logits = torch.randn(3, 17, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    out = sampler(logits, build([SamplingParams(temperature=0.0, logprobs=2)] * 3, 17))
    assert torch.equal(out.token_ids, logits.float().argmax(-1))
    assert out.logprobs.dtype == torch.float32
