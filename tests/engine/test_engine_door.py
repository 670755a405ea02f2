"""The engine's door for the workers: reserve (all or nothing), join with transferred KV, release.

Block ids are exact: a fresh pool hands out the lowest blank ids first, and a released sequence's
blocks go back blank-first (`engine/block_pool.py` documents the free-list order).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import LoadedModel, load_model
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, SequenceStatus

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SHARED = [11, 12, 13, 14, 15, 16, 17, 18]  # two full blocks of 4


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Callable[[str], Path]) -> LoadedModel:
    return load_model(tiny_model_dir("llama-2l"))


def engine(loaded: LoadedModel, num_blocks: int, **policy: bool) -> LLMEngine:
    return LLMEngine(loaded, EngineConfig(block_size=4, num_blocks=num_blocks, **policy))


def run_to_end(e: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while e.has_unfinished():
        for out in e.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        e.pool.check_integrity()
    return tokens


def joined(e: LLMEngine, request_id: str, prompt: list[int], token: int) -> tuple[Sequence, list[int]]:
    seq = e.new_sequence(request_id, prompt, GREEDY)
    ids = e.reserve(seq)
    assert ids is not None
    e.join(seq, token)
    return seq, ids


def test_reserve_is_all_or_nothing(loaded: LoadedModel) -> None:
    e = engine(loaded, 6)
    a = e.new_sequence("a", [*SHARED, 19, 20], GREEDY)
    assert e.reserve(a) == [0, 1, 2]
    assert (a.status, a.block_table, a.num_cached_tokens) == (SequenceStatus.RESERVED, [0, 1, 2], 0)
    e.pool.check_integrity()

    short = e.new_sequence("short", list(range(30, 47)), GREEDY)  # 17 tokens: 5 blocks, 3 free
    before = e.pool.stats()
    assert e.reserve(short) is None
    assert e.pool.stats() == before
    assert (short.block_table, short.block_hashes, short.num_computed_tokens) == ([], [], 0)
    assert short.status is SequenceStatus.WAITING and not e.release(short)  # the engine holds nothing
    e.pool.check_integrity()

    e.join(a, 21)  # its two full blocks enter the prefix cache
    assert e.release(a)
    assert e.pool.stats() == {"total": 6, "free": 6, "held": 0, "cached": 2, "cached_free": 2}

    other = e.new_sequence("other", list(range(40, 52)), GREEDY)
    assert e.reserve(other) == [2, 3, 4]  # blank blocks first: the cached prefix 0, 1 survives
    # shares blocks 0 and 1 (free, cached) and needs 2 fresh: 3 are free, but sharing revives 2 of
    # them, so only 1 is left; nothing is taken, the cached blocks stay free
    hit = e.new_sequence("hit", [*SHARED, 1, 2, 3, 4, 5], GREEDY)
    before = e.pool.stats()
    assert e.reserve(hit) is None
    assert e.pool.stats() == before and e.pool.ref_count(0) == e.pool.ref_count(1) == 0
    assert (hit.block_table, hit.num_cached_tokens) == ([], 0)
    e.pool.check_integrity()

    assert e.release(other)
    assert e.reserve(hit) == [2, 3]  # prefix hit first, fresh blocks for the rest
    assert (hit.block_table, hit.num_cached_tokens) == ([0, 1, 2, 3], 8)
    assert e.release(hit)
    e.pool.check_integrity()
    assert e.pool.num_free_blocks == 6


def test_join_decodes_from_token_one_with_the_transferred_blocks(loaded: LoadedModel) -> None:
    prompt = [*SHARED, 19, 20]
    colocated = engine(loaded, 16)
    colocated.add_request("r", prompt, GREEDY)
    want = run_to_end(colocated)["r"]

    prefill = engine(loaded, 16, prefill_only=True, keep_blocks_on_finish=True)
    p_seq = prefill.add_request("r", prompt, GREEDY)
    assert run_to_end(prefill) == {"r": want[:1]}
    assert p_seq.is_finished and p_seq.block_table == [0, 1, 2]  # kept for shipping

    decode = engine(loaded, 16)
    d_seq = decode.new_sequence("r", prompt, GREEDY)
    ids = decode.reserve(d_seq)
    assert ids == [0, 1, 2]
    decode.runner.kv_cache[ids] = prefill.runner.kv_cache[p_seq.block_table]  # the "transfer"
    decode.join(d_seq, want[0])
    assert d_seq.status is SequenceStatus.RUNNING
    assert (d_seq.num_computed_tokens, d_seq.token_ids, d_seq.block_table) == (10, [*prompt, want[0]], ids)
    out = decode.schedule()
    assert [(item.seq, item.num_new_tokens) for item in out.scheduled] == [(d_seq, 1)]  # token 1 only
    [first] = decode.finish_step(out, decode.execute(out))
    rest = run_to_end(decode)["r"]
    assert [*want[:1], *first.new_token_ids, *rest] == want  # token for token the colocated output
    assert d_seq.is_finished and d_seq.block_table == []
    assert decode.pool.stats()["held"] == 0
    decode.pool.check_integrity()

    assert prefill.release(p_seq) and not prefill.release(p_seq)
    assert prefill.pool.stats()["held"] == 0
    prefill.pool.check_integrity()


def test_release_frees_exactly_once_wherever_the_sequence_is(loaded: LoadedModel) -> None:
    e = engine(loaded, 8)
    reserved = e.new_sequence("reserved", [1, 2, 3, 4, 5], GREEDY)
    assert e.reserve(reserved) == [0, 1]
    running, ids = joined(e, "running", [6, 7, 8, 9], 10)
    assert ids == [2]
    queued = e.add_request("queued", [10, 11, 12, 13, 14, 15], GREEDY)
    out = e.schedule()  # "running" grows into a second block; "queued" gets its two
    assert (running.block_table, queued.block_table) == ([2, 3], [4, 5])
    e.finish_step(out, e.execute(out))
    assert e.pool.num_held_blocks == 6

    for seq, blocks_left in ((reserved, 4), (running, 2), (queued, 0)):
        assert e.release(seq)
        assert seq.is_finished and seq.block_table == []
        assert e.pool.num_held_blocks == blocks_left
        assert not e.release(seq)  # a second release changes nothing
        assert e.pool.num_held_blocks == blocks_left
        e.pool.check_integrity()
    assert not e.has_unfinished()
    with pytest.raises(ValueError, match="not reserved"):
        e.join(reserved, 1)


def test_join_needs_a_reservation(loaded: LoadedModel) -> None:
    e = engine(loaded, 4)
    seq = e.new_sequence("r", [1, 2, 3], GREEDY)
    with pytest.raises(ValueError, match="not reserved"):
        e.join(seq, 4)
    assert seq.status is SequenceStatus.WAITING and seq.token_ids == [1, 2, 3]
    e.pool.check_integrity()
