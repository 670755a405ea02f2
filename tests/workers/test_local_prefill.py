"""A decode worker prefilling locally (conditional disaggregation): the same greedy output as the
prefill-worker path and the colocated worker, chunks within the step budget the running decodes leave,
the reports the router decides by, and clean pools after."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace

import pytest

from coordinator.router import prompt_run
from engine.config import EngineConfig, long_prompt, prefill_budget
from engine.llm_engine import LLMEngine
from engine.loader import LoadedModel
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from splitserve import wire
from splitserve.v1 import serving_pb2
from tests.workers.conftest import Cluster, execution_request
from tests.workers.test_disaggregated import assert_quiescent, dispatch, random_prompt

LENGTH = serving_pb2.FINISH_REASON_LENGTH
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def join_decodes(engine: LLMEngine, rng: random.Random, *max_tokens: int) -> list[Sequence]:
    """One greedy sequence of a 6-token prompt per `max_tokens`, joined as if its KV had landed with
    token 7: decoding from the next step on."""
    decodes = []
    for i, n in enumerate(max_tokens):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        seq = engine.new_sequence(f"d{i}", random_prompt(rng, 6), params)
        assert engine.reserve(seq) is not None
        engine.join(seq, 7)
        decodes.append(seq)
    return decodes


def test_running_decodes_take_the_step_budget_before_a_prompt_chunk(loaded: LoadedModel) -> None:
    """The prompt is older than the decodes in the running list, yet every step serves both decodes
    and gives the prompt only what is left of the 16-token budget."""
    engine = LLMEngine(loaded, EngineConfig(block_size=4, num_blocks=128, max_num_batched_tokens=16))
    rng = random.Random(1)
    long = engine.add_request("long", random_prompt(rng, 60), GREEDY)
    engine.step()  # its first chunk: 16 of 60 tokens
    join_decodes(engine, rng, 8, 8)
    while long.num_output_tokens == 0:  # its prefill, chunk by chunk
        out = engine.schedule()
        chunks = {item.seq.request_id: item.num_new_tokens for item in out.scheduled}
        assert chunks["d0"] == chunks["d1"] == 1 and out.num_tokens <= 16
        assert chunks["long"] == min(14, long.num_uncomputed_tokens)
        engine.finish_step(out, engine.execute(out))
    while engine.has_unfinished():
        engine.step()
    engine.pool.check_integrity()


def test_a_prefill_beside_decodes_stays_within_prefill_tokens_while_decoding(loaded: LoadedModel) -> None:
    """With the cap at 6 of a 64-token budget, no step that carries a decode schedules more than 6
    prompt tokens (two prompts queued: the cap is for both together); once nothing decodes, a prompt
    takes the whole budget; the output is the uncapped engine's."""

    def run(cap: int) -> tuple[dict[str, list[int]], list[tuple[int, int]]]:
        config = EngineConfig(
            block_size=4, num_blocks=128, max_num_batched_tokens=64, prefill_tokens_while_decoding=cap
        )
        engine = LLMEngine(loaded, config)
        rng = random.Random(3)
        decodes = join_decodes(engine, rng, 12, 20)
        prompts = [engine.add_request(f"p{i}", random_prompt(rng, n), GREEDY) for i, n in enumerate((40, 9))]
        late = None
        steps = []  # (decodes, prompt tokens) per step
        while engine.has_unfinished():
            out = engine.schedule()
            chunks = [
                i.num_new_tokens for i in out.scheduled if i.seq.num_computed_tokens < i.seq.num_prompt_tokens
            ]
            steps.append((len(out.scheduled) - len(chunks), sum(chunks)))
            engine.finish_step(out, engine.execute(out))
            if late is None and all(s.is_finished for s in decodes + prompts):
                late = engine.add_request("late", random_prompt(rng, 50), GREEDY)  # nothing decodes now
        engine.pool.check_integrity()
        seqs = [*decodes, *prompts, late]
        return {s.request_id: s.output_token_ids for s in seqs if s is not None}, steps

    capped, steps = run(6)
    assert all(prefill <= 6 for decoding, prefill in steps if decoding), steps
    assert any(decoding and prefill == 6 for decoding, prefill in steps)  # the cap is used, not starved
    assert (0, 50) in steps  # the late prompt, alone: one step of the whole budget
    uncapped, free_steps = run(0)
    assert any(decoding and prefill > 6 for decoding, prefill in free_steps)  # the cap made the difference
    assert capped == uncapped


def test_short_prompts_whole_leave_the_cap_to_long_prompts_chunks(loaded: LoadedModel) -> None:
    """Cap 6 beside decodes, threshold 16, `short_prompts_whole`: a 12-token prompt arriving beside
    two decodes runs whole in one step (one gap for them, not two), while a 40-token prompt's chunks
    stay within the cap; without it the short prompt takes two capped steps. The outputs are the
    same; a config asking for it without a threshold is refused, naming what is missing."""

    def run(whole: bool) -> tuple[dict[str, list[int]], list[dict[str, int]]]:
        config = EngineConfig(
            block_size=4,
            num_blocks=128,
            max_num_batched_tokens=64,
            prefill_tokens_while_decoding=6,
            long_prefill_token_threshold=16,
            short_prompts_whole=whole,
        )
        engine = LLMEngine(loaded, config)
        rng = random.Random(5)
        decodes = join_decodes(engine, rng, 30, 30)
        prompts = [engine.add_request(f"p{n}", random_prompt(rng, n), GREEDY) for n in (12, 40)]
        steps = []  # prompt tokens per request, in steps that carry a decode
        while any(p.num_output_tokens == 0 for p in prompts):
            out = engine.schedule()
            assert out.num_tokens <= 64  # past the caps, never past the step budget
            chunks = {i.seq.request_id: i.num_new_tokens for i in out.scheduled if i.is_prompt_chunk}
            if any(not i.is_prompt_chunk for i in out.scheduled):
                steps.append(chunks)
            engine.finish_step(out, engine.execute(out))
        while engine.has_unfinished():
            engine.step()
        engine.pool.check_integrity()
        return {s.request_id: s.output_token_ids for s in decodes + prompts}, steps

    outputs, steps = run(whole=True)
    assert steps[0] == {"p12": 12}  # whole, the long prompt waiting that step
    assert all(step.get("p40", 0) <= 6 for step in steps) and sum(s.get("p40", 0) for s in steps) == 40, steps
    capped, capped_steps = run(whole=False)
    assert [step.get("p12", 0) for step in capped_steps[:2]] == [6, 6]
    assert outputs == capped
    with pytest.raises(ValueError, match="short_prompts_whole needs long_prefill_token_threshold > 0"):
        EngineConfig(short_prompts_whole=True)


def test_the_time_cap_turns_the_measured_prompt_token_cost_into_tokens(loaded: LoadedModel) -> None:
    """`prefill_ms_while_decoding` 12: no cap until a step with prompt tokens beside decodes is
    timed. Prompt tokens add 3 ms a step plus 2 ms each to the decode steps' 10 ms: one step of 40
    gives only an average (83 ms / 40: cap 5), a second of another size the fit (3 + 2 x n: cap
    (12 - 3) / 2 = 4), which later steps keep and the report says. With a token cap too the lower
    wins; however dear a token, one still runs a step."""
    config = EngineConfig(
        block_size=4, num_blocks=128, max_num_batched_tokens=64, prefill_ms_while_decoding=12
    )
    engine = LLMEngine(loaded, config)
    rng = random.Random(7)
    join_decodes(engine, rng, 40, 40)

    def timed_step() -> int:
        out = engine.schedule()
        prompt = sum(i.num_new_tokens for i in out.scheduled if i.is_prompt_chunk)
        engine.finish_step(out, engine.execute(out), (10.0 + (3.0 + 2.0 * prompt if prompt else 0.0)) / 1e3)
        return prompt

    assert [timed_step() for _ in range(4)] == [0] * 4  # two cold steps, then the decode steps' 10 ms
    assert engine.decode_step_ms == 10.0 and engine.scheduler.prompt_tokens_while_decoding() == 0
    engine.add_request("p", random_prompt(rng, 40), GREEDY)
    assert timed_step() == 40  # not yet measured: the whole prompt beside the decodes
    assert engine.scheduler.prompt_tokens_while_decoding() == 5
    engine.add_request("q", random_prompt(rng, 30), GREEDY)
    assert [timed_step() for _ in range(8)] == [5, 4, 4, 4, 4, 4, 4, 1]  # the last: one token left
    fixed, per_token = engine.scheduler.prompt_cost
    assert fixed == pytest.approx(3.0) and per_token == pytest.approx(2.0)
    while engine.has_unfinished():
        engine.step()
    engine.pool.check_integrity()
    both = LLMEngine(loaded, replace(config, prefill_tokens_while_decoding=3))
    both.scheduler.prompt_cost = (3.0, 2.0)
    assert both.scheduler.prompt_tokens_while_decoding() == 3  # both caps: the lower one
    both.scheduler.prompt_cost = (3.0, 50.0)  # dearer than the whole time cap
    assert both.scheduler.prompt_tokens_while_decoding() == 1


def test_steps_on_borrowed_cores_have_a_fit_of_their_own_and_a_cap_by_it(loaded: LoadedModel) -> None:
    """A widened step (run on borrowed cores too) feeds only `borrowed_prompt_cost`: the home fits
    and the router's step fit keep what the worker's own cores do. A step scheduled `widened` sizes
    its prompt chunk beside decodes by that fit: the 12.25 ms cap buys (12.25 - 1) / 0.5 = 22 tokens
    there against (12.25 - 3) / 2 = 4 at home."""
    config = EngineConfig(
        block_size=4, num_blocks=128, max_num_batched_tokens=64, prefill_ms_while_decoding=12.25
    )
    engine = LLMEngine(loaded, config)
    rng = random.Random(8)
    join_decodes(engine, rng, 60, 60)

    def timed_step(widened: bool) -> int:
        out = engine.schedule(widened=widened)
        prompt = sum(i.num_new_tokens for i in out.scheduled if i.is_prompt_chunk)
        ms = 10.0 + ((1.0 + 0.5 * prompt) if widened else (3.0 + 2.0 * prompt)) * bool(prompt)
        engine.finish_step(out, engine.execute(out), ms / 1e3, widened=widened)
        return prompt

    def prefill(request_id: str, n: int, widened: bool) -> list[int]:
        engine.add_request(request_id, random_prompt(rng, n), GREEDY)
        assert engine.short_prompt_pending()
        chunks = []
        while engine.short_prompt_pending():
            chunks.append(timed_step(widened))
        return chunks

    for _ in range(4):
        timed_step(False)  # two cold steps, then the decode steps' 10 ms
    assert not engine.short_prompt_pending()
    assert prefill("h1", 48, False) == [48]  # no cap until a cost is measured
    assert prefill("h2", 20, False)[0] == 5  # the average first (99 ms / 48 a token), then the fit
    assert engine.scheduler.prompt_cost == (pytest.approx(3.0), pytest.approx(2.0))
    home = (engine.step_cost.us_per_token, engine.step_cost.base_ms, engine.scheduler.prompt_cost)
    # widened: the home cap sizes the first chunk (4 tokens), the average the next (0.75 ms a token: 16)
    assert prefill("w1", 20, True) == [4, 16]
    assert (engine.step_cost.us_per_token, engine.step_cost.base_ms, engine.scheduler.prompt_cost) == home
    assert engine.decode_step_ms == 10.0
    assert engine.borrowed_prompt_cost.us_per_token == pytest.approx(500.0)
    assert engine.borrowed_prompt_cost.base_ms == pytest.approx(1.0)
    assert engine.prompt_tokens_while_decoding_widened() == 22  # what the worker reports
    assert engine.scheduler.prompt_tokens_while_decoding() == 4
    engine.add_request("capped", random_prompt(rng, 40), GREEDY)
    assert timed_step(True) == 22 and engine.scheduler.prompt_cost == home[2]
    assert timed_step(False) == 4
    while engine.has_unfinished():
        engine.step()
    engine.pool.check_integrity()


def test_a_short_prompt_behind_a_long_one_starts_next_step_under_the_threshold(loaded: LoadedModel) -> None:
    """With `long_prefill_token_threshold` 16 of a 64-token budget, the 200-token prompt takes 16
    tokens a step and the 10-token prompt that arrives behind it is prefilled in the very next step;
    without it, the long prompt fills two more steps first. Outputs are the same either way."""

    def run(threshold: int) -> tuple[dict[str, list[int]], int, list[int]]:
        config = EngineConfig(
            block_size=4, num_blocks=128, max_num_batched_tokens=64, long_prefill_token_threshold=threshold
        )
        engine = LLMEngine(loaded, config)
        rng = random.Random(5)
        long = engine.add_request("long", random_prompt(rng, 200), GREEDY)
        engine.step()
        short = engine.add_request("short", random_prompt(rng, 10), GREEDY)
        steps, first_token_step, chunks = 0, 0, []
        while engine.has_unfinished():
            out = engine.schedule()
            chunks += [i.num_new_tokens for i in out.scheduled if i.num_new_tokens > 1]
            engine.finish_step(out, engine.execute(out))
            steps += 1
            first_token_step = first_token_step or (steps if short.num_output_tokens else 0)
        engine.pool.check_integrity()
        return {s.request_id: s.output_token_ids for s in (long, short)}, first_token_step, chunks

    capped, capped_wait, capped_chunks = run(16)
    assert capped_wait == 1 and max(capped_chunks) == 16
    free, free_wait, _ = run(0)
    assert free_wait == 3  # 136 tokens of the long prompt left: two full steps, then its last 8 beside it
    assert capped == free


def test_short_prompts_go_before_the_long_prompts_chunk_which_keeps_a_block(loaded: LoadedModel) -> None:
    """Threshold 32: a 10-token prompt arriving while a 200-token one runs is prefilled in the very
    next step, the long prompt keeping one block (4 tokens) of it so that the short prompt's step stays
    short, whether the budget is 32 or 64; five arriving at once want 50, and the long prompt still
    takes one block of each of their steps. Without the threshold, at budget 32, the short prompts wait for the
    long one's last chunk; the outputs are the same either way."""

    def run(
        threshold: int, shorts: int, budget: int = 32
    ) -> tuple[dict[str, list[int]], list[dict[str, int]]]:
        config = EngineConfig(
            block_size=4,
            num_blocks=256,
            max_num_batched_tokens=budget,
            long_prefill_token_threshold=threshold,
        )
        engine = LLMEngine(loaded, config)
        rng = random.Random(9)
        seqs = [engine.add_request("long", random_prompt(rng, 200), GREEDY)]
        engine.step()
        seqs += [engine.add_request(f"s{i}", random_prompt(rng, 10), GREEDY) for i in range(shorts)]
        steps = []
        while engine.has_unfinished():
            out = engine.schedule()
            steps.append({i.seq.request_id: i.num_new_tokens for i in out.scheduled if i.num_new_tokens > 1})
            assert out.num_tokens <= budget
            engine.finish_step(out, engine.execute(out))
        engine.pool.check_integrity()
        return {s.request_id: s.output_token_ids for s in seqs}, steps

    outputs, steps = run(32, 1)
    assert steps[0] == {"s0": 10, "long": 4} and run(32, 1, budget=64)[1][0] == steps[0]
    assert steps[1] == {"long": 31}  # no short prompt left: the long chunk fills the budget again (less
    # s0's decode token)
    free_outputs, free_steps = run(0, 1)
    assert free_steps[0] == {"long": 32} and next(i for i, s in enumerate(free_steps) if "s0" in s) == 5
    assert outputs == free_outputs
    outputs, steps = run(32, 5)
    assert steps[0] == {"s0": 10, "s1": 10, "s2": 8, "long": 4}
    long_chunks = [step.get("long", 0) for step in steps]
    last = max(i for i, n in enumerate(long_chunks) if n)
    assert min(long_chunks[:last]) >= 4 and sum(long_chunks) == 200 - 32  # every step until its last
    assert outputs == run(0, 5)[0]


def test_long_prompts_under_the_threshold_prefill_one_at_a_time(loaded: LoadedModel) -> None:
    """Two 100-token prompts and a 10-token one behind them, threshold 16 of a 64-token budget: no
    step carries chunks of two prompts with more than 16 tokens left, so the second long prompt
    starts only with the first one's last chunk, while the short one starts at once."""
    config = EngineConfig(
        block_size=4, num_blocks=128, max_num_batched_tokens=64, long_prefill_token_threshold=16
    )
    engine = LLMEngine(loaded, config)
    rng = random.Random(7)
    first, second = (engine.add_request(f"long{i}", random_prompt(rng, 100), GREEDY) for i in range(2))
    short = engine.add_request("short", random_prompt(rng, 10), GREEDY)
    first_token_step: dict[str, int] = {}
    step = 0
    while engine.has_unfinished():
        out = engine.schedule()
        long_chunks = [i for i in out.scheduled if i.seq.num_uncomputed_tokens > 16]
        assert len(long_chunks) <= 1, [(i.seq.request_id, i.num_new_tokens) for i in out.scheduled]
        engine.finish_step(out, engine.execute(out))
        step += 1
        for seq in (first, second, short):
            if seq.num_output_tokens and seq.request_id not in first_token_step:
                first_token_step[seq.request_id] = step
    engine.pool.check_integrity()
    assert first_token_step["short"] == 1
    assert first_token_step["long0"] == 7  # ceil(100 / 16) chunks
    assert first_token_step["long1"] == 7 + 6  # its first chunk rode with long0's last (4 tokens)


def beside_a_long_prompt(
    loaded: LoadedModel, cap: int, long_tokens: int
) -> tuple[LLMEngine, Sequence, random.Random]:
    """A decode worker's engine (4-token blocks, threshold 16, `cap` prompt tokens a step beside
    decodes) running two 80-token decodes and the first step of a `long_tokens` prompt."""
    config = EngineConfig(
        block_size=4,
        num_blocks=256,
        max_num_batched_tokens=64,
        prefill_tokens_while_decoding=cap,
        long_prefill_token_threshold=16,
    )
    engine = LLMEngine(loaded, config)
    rng = random.Random(cap)
    join_decodes(engine, rng, 80, 80)
    long = engine.add_request("long", random_prompt(rng, long_tokens), GREEDY)
    engine.step()
    return engine, long, rng


def test_the_router_prices_a_short_prompt_on_the_decode_worker_in_its_schedulers_order(
    loaded: LoadedModel,
) -> None:
    """A 200-token prompt prefilling beside two decodes, 12 prompt tokens a step at most, threshold 16:
    three 14-token prompts arriving together finish within the steps, and beside the long prompt's
    tokens, that `coordinator.router.prompt_run` counts from what the worker reports at each one's
    arrival, not after the long prompt's 180-odd tokens: exactly for the first; behind other short
    prompts it may be a step (and the long prompt's block in it) late (its docstring)."""
    engine, long, rng = beside_a_long_prompt(loaded, cap=12, long_tokens=200)
    sched = engine.scheduler
    shorts, predicted = [], []
    for i in range(3):  # each priced against the queue it joins, as the worker reports it
        left = sched.prompt_tokens_left()
        spare = prefill_budget(64, sched.prompt_tokens_while_decoding(), len(sched.running))
        long_left = sum(n for n in left if long_prompt(16, n))
        predicted.append(prompt_run(sum(left), long_left, 14, spare, 16, 4))
        shorts.append(engine.add_request(f"s{i}", random_prompt(rng, 14), GREEDY))
    long_before, steps = long.num_uncomputed_tokens, 0
    for i, (short, run) in enumerate(zip(shorts, predicted, strict=True)):
        while short.num_output_tokens == 0:
            engine.step()
            steps += 1
        computed_long = long_before - long.num_uncomputed_tokens
        if i == 0:
            assert (steps, computed_long + 14) == (run.steps, run.tokens), run
        else:  # a step late at most, the long prompt's block taken in more of them
            assert steps - run.steps in (0, 1), (i, steps, run)
            assert run.tokens - 14 * (i + 1) <= computed_long <= steps * 4, (i, computed_long, run)
    assert long.num_uncomputed_tokens > 150  # the long prompt is far from done
    while engine.has_unfinished():
        engine.step()
    engine.pool.check_integrity()


def test_a_short_prompt_starts_beside_a_long_one_under_a_cap_of_a_block(loaded: LoadedModel) -> None:
    """A 100-token prompt prefilling beside two decodes, the cap at 4 prompt tokens a step (one block,
    as a decode worker's time cap can fall to beside long decodes), threshold 16: a 10-token prompt
    arriving there starts at once, the long prompt keeping half of each step it joins, where taking
    its whole block would leave the short one nothing until the long prompt is done."""
    engine, long, rng = beside_a_long_prompt(loaded, cap=4, long_tokens=100)
    short = engine.add_request("short", random_prompt(rng, 10), GREEDY)
    out = engine.schedule()
    assert {i.seq.request_id: i.num_new_tokens for i in out.scheduled if i.is_prompt_chunk} == {
        "long": 2,
        "short": 2,
    }
    engine.finish_step(out, engine.execute(out))
    steps = 1
    while short.num_output_tokens == 0:
        engine.step()
        steps += 1
    assert steps == 3 and long.num_uncomputed_tokens > 80  # 2, then 4 and 4 of the short prompt's 10
    assert steps == prompt_run(96, 96, 10, 4, 16, 4).steps  # as the router counts it
    while engine.has_unfinished():
        engine.step()
    engine.pool.check_integrity()


def test_a_long_prompt_left_no_token_waits_and_the_short_one_beside_it_starts(loaded: LoadedModel) -> None:
    """One prompt token a step beside two decodes, threshold 16: a 100-token prompt and a 10-token
    one waiting together. The long one's half of that token is none, so it waits (no chunk of no
    tokens reaches the model) while the short one takes the token every step (its last one, counted
    with the decodes, leaves the long one its first). Every prompt finishes and the pool is whole."""
    config = EngineConfig(
        block_size=4, num_blocks=256, max_num_batched_tokens=64, prefill_tokens_while_decoding=1,
        long_prefill_token_threshold=16,
    )  # fmt: skip
    engine = LLMEngine(loaded, config)
    rng = random.Random(2)
    join_decodes(engine, rng, 40, 40)
    long = engine.add_request("long", random_prompt(rng, 100), GREEDY)
    short = engine.add_request("short", random_prompt(rng, 10), GREEDY)
    steps = 0
    while short.num_output_tokens == 0:  # its 10 tokens, one a step (no chunk of none in between)
        out = engine.schedule()
        chunks = {i.seq.request_id: i.num_new_tokens for i in out.scheduled if i.is_prompt_chunk}
        assert chunks["short"] == 1 and chunks.get("long", 1) == 1, chunks
        engine.finish_step(out, engine.execute(out))
        steps += 1
    assert steps == 10 and long.num_computed_tokens <= 1  # its last one counts with the decodes
    while engine.has_unfinished():
        engine.step()
    assert long.num_output_tokens == short.num_output_tokens == 8
    engine.pool.check_integrity()


async def test_three_paths_give_the_same_greedy_output(
    cluster: Cluster, greedy: Callable[[list[int], int], list[int]]
) -> None:
    """Remote (P computes, KV shipped), local (D prefills itself, chunked beside its decodes) and
    colocated: token for token the offline engine's greedy output."""
    p = await cluster.start("prefill", "p0")
    d = await cluster.start("decode", "d0", max_num_batched_tokens=16)
    c = await cluster.start("colocated", "c0", max_num_batched_tokens=16)
    coord, identity = cluster.coordinator, p.engine.loaded.identity
    rng = random.Random(11)
    prompts = [random_prompt(rng, n) for n in (37, 5, 23)]
    remote = {10 + i: prompt for i, prompt in enumerate(prompts)}
    local = {20 + i: prompt for i, prompt in enumerate(prompts)}
    colocated = {30 + i: prompt for i, prompt in enumerate(prompts)}
    for rid, prompt in remote.items():  # decoding on D while D prefills the local ones below
        await dispatch(coord, p, d, execution_request(rid, prompt, 12, identity=identity))
    for rid, prompt in local.items():
        await coord.send("d0", decode={"request": execution_request(rid, prompt, 12, identity=identity)})
    for rid, prompt in colocated.items():
        await coord.send("c0", decode={"request": execution_request(rid, prompt, 12, identity=identity)})
    got = await coord.collect(set(remote) | set(local) | set(colocated))
    for rid in remote:
        want = (greedy(remote[rid], 12), LENGTH)
        assert got[rid] == got[rid + 10] == got[rid + 20] == want
    await assert_quiescent(cluster, p, d, c)


async def test_decode_worker_reports_what_the_router_weighs(cluster: Cluster) -> None:
    """Its heartbeat carries its step budget, its measured cost and its prefix cache (the prompt it
    prefilled), so the next turn of the conversation can be found there."""
    d = await cluster.start("decode", "d0", max_num_batched_tokens=24)
    coord = cluster.coordinator
    prompt = random_prompt(random.Random(5), 30)
    await coord.send(
        "d0", decode={"request": execution_request(1, prompt, 4, identity=d.engine.loaded.identity)}
    )
    await coord.collect({1})
    await assert_quiescent(cluster, d)
    stored: set[int] = set()
    while True:  # heartbeats announce its prefix cache as deltas; one comes after the request ended
        _, env = await coord.expect("heartbeat")
        hb = env.heartbeat
        stored |= set(wire.unpack_hashes(hb.prefix_cache.stored))
        if len(stored) >= 30 // 4 and hb.load.running_requests == 0:  # the prompt's 7 full blocks
            break
    assert hb.load.step_token_budget == 24 and hb.load.prefill_us_per_token > 0
    assert hb.load.queued_tokens == 0
