"""Greedy parity: the engine's output equals transformers' greedy `generate`, token for token."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from tests.hf_reference import HFGreedy

SHAPES = ["llama-2l", "qwen2-2l", "qwen3-2l", "mistral-2l"]
PROMPT_LENGTHS = [1, 7, 16, 33, 50]
MAX_TOKENS = 12


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    greedy = HFGreedy(model_dir)
    return [greedy(ids, max_new_tokens) for ids in prompts]


def random_prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("shape", SHAPES)
def test_greedy_matches_transformers_with_chunked_prefill(
    shape: str, tiny_model_dir: Callable[[str], Path]
) -> None:
    model_dir = tiny_model_dir(shape)
    # a chunk budget of 13 divides none of the prompt lengths, so prompts straddle steps
    llm = LLM(model_dir, block_size=4, max_num_batched_tokens=13, enable_prefix_caching=False)
    prompts = random_prompts(llm.engine.loaded.config.vocab_size, PROMPT_LENGTHS, seed=1)
    ours = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    expected = hf_greedy(model_dir, prompts, MAX_TOKENS)
    for out, want in zip(ours, expected, strict=True):
        assert out.token_ids == want
        assert out.text == llm.tokenizer.decode(want, skip_special_tokens=True)
    llm.engine.pool.check_integrity()
    assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks


def test_prefix_cache_hit_gives_identical_output_with_fewer_computed_tokens(
    tiny_model_dir: Callable[[str], Path],
) -> None:
    model_dir = tiny_model_dir("llama-2l")
    llm = LLM(model_dir, block_size=4, max_num_batched_tokens=64)
    vocab = llm.engine.loaded.config.vocab_size
    shared = random_prompts(vocab, [40], seed=2)[0]
    first, second = [*shared, 5, 6, 7], [*shared, 8, 9]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    llm.generate([first], params)
    computed_before = llm.engine.stats.tokens_computed
    [hit] = llm.generate([second], params)
    computed_hit = llm.engine.stats.tokens_computed - computed_before
    assert hit.num_cached_tokens == 40
    assert computed_hit == len(second) - 40 + params.max_tokens - 1
    cold = LLM(model_dir, block_size=4, max_num_batched_tokens=64, enable_prefix_caching=False)
    [want] = cold.generate([second], params)
    assert hit.token_ids == want.token_ids == hf_greedy(model_dir, [second], 6)[0]
    llm.engine.pool.check_integrity()
    assert llm.engine.pool.stats()["held"] == 0


def test_preemption_under_a_tiny_pool_keeps_greedy_output(tiny_model_dir: Callable[[str], Path]) -> None:
    model_dir = tiny_model_dir("llama-2l")
    prompts = random_prompts(512, [9, 14, 20, 5], seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=16)
    roomy = LLM(model_dir, block_size=4, enable_prefix_caching=False).generate(prompts, params)
    tight = LLM(model_dir, block_size=4, num_blocks=12, enable_prefix_caching=False, debug_integrity=True)
    squeezed = tight.generate(prompts, params)
    assert tight.engine.stats.preemptions > 0
    assert [o.token_ids for o in squeezed] == [o.token_ids for o in roomy]
    assert tight.engine.pool.num_free_blocks == 12
