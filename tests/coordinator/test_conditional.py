"""Conditional disaggregation in the router: per request, prefill on a prefill worker and ship the KV,
or prefill on the decode worker itself, by the estimates built from the workers' reports (queue,
measured per-token cost, prefix events, step budget, transfer time). Seed 001's "cache hit that loses",
with the per-token cost the tiny model measures here."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from coordinator.router import LOCAL, REMOTE, RunningDecode, prefix_block_hashes
from coordinator.routing_policy import RoutingPolicy
from coordinator.served_model import ServedModel
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import load_model
from engine.sampling_params import SamplingParams
from tests.coordinator.conftest import Pool, document_on_p_pool

# D: 64 tokens a step, 8 running decodes (56 spare), 20 ms a decode step, 3 ms of exposed transfer
DECODE_LOAD = {"step_token_budget": 64, "running_requests": 8, "decode_step_ms": 20.0, "kv_transfer_ms": 3.0}
# D's own prompt fit beside its decodes (2 ms a step that carries any, 100 us a token), its cap
# there (16 tokens a step) and its long-prompt threshold
D_HOME_FIT = {
    "prompt_beside_decodes_us_per_token": 100.0,
    "prompt_beside_decodes_base_ms": 2.0,
    "prefill_tokens_while_decoding": 16,
    "long_prefill_token_threshold": 128,
}
# and on borrowed cores: 1 ms a step, 40 us a token, 48 tokens a step under its cap there
D_BORROWED_FIT = D_HOME_FIT | {
    "prompt_on_borrowed_cores_us_per_token": 40.0,
    "prompt_on_borrowed_cores_base_ms": 1.0,
    "prefill_tokens_while_decoding_on_borrowed_cores": 48,
}


def conditional_pool(served_model: ServedModel, p_queued_tokens: int) -> Pool:
    """P measured at 50 us/token with `p_queued_tokens` queued; D as DECODE_LOAD; at most 256
    uncached tokens prefilled on D."""
    pool = Pool(served_model, RoutingPolicy("conditional", local_prefill_max_tokens=256))
    pool.add("p", "prefill")
    pool.add("d", "decode", num_blocks=1000)
    pool.report("p", queued_tokens=p_queued_tokens, us_per_token=50.0)
    pool.report("d", **DECODE_LOAD)
    return pool


def test_short_prompt_prefills_on_the_decode_worker_when_the_prefill_worker_is_queued(
    served_model: ServedModel,
) -> None:
    pool = conditional_pool(served_model, p_queued_tokens=4000)  # 200 ms of queue on P
    short = list(range(100, 132))
    placement = pool.router.place(short)
    assert placement is not None and placement.path == LOCAL and placement.colocated
    assert placement.decode.worker_id == "d" and placement.decision == "local"
    # P: 200 ms queue + 32 x 50 us + 3 ms transfer, and token 1 streams from D at its next step
    # boundary (--first-token-from decode): half its 20 ms decode step; D: 32 x 50 us (the pool's
    # cost) + one 20 ms step, after half the 20 ms decode step in flight
    assert placement.remote_ttft_ms == pytest.approx(200.0 + 1.6 + 3.0 + 10.0)
    assert placement.local_ttft_ms == placement.estimated_ttft_ms == pytest.approx(1.6 + 20.0 + 10.0)
    routing = placement.routing()
    assert routing.path == LOCAL and routing.decode_spare_tokens == 56 and routing.uncached_tokens == 32
    assert routing.prefill_queue_ms == pytest.approx(200.0) and routing.transfer_ms == pytest.approx(3.0)

    pool.report("p", us_per_token=50.0)  # P idle: the hop (3 ms + 10) is cheaper than a decode step (20 ms)
    placement = pool.router.place(short)
    assert placement is not None and placement.path == REMOTE and placement.prefill.worker_id == "p"
    assert placement.local_ttft_ms == pytest.approx(31.6)
    assert placement.estimated_ttft_ms == pytest.approx(14.6)


def test_a_first_token_streamed_from_the_prefill_worker_waits_for_no_decode_step(
    served_model: ServedModel,
) -> None:
    """--first-token-from prefill: the client gets token 1 as P samples it, so the remote estimate
    has no decode step in it; with D idle there is none to wait out either way."""
    pool = Pool(served_model, RoutingPolicy("conditional", first_token_from="prefill"))
    pool.add("p", "prefill")
    pool.add("d", "decode", num_blocks=1000)
    pool.report("p", us_per_token=50.0)
    pool.report("d", **DECODE_LOAD)
    placement = pool.router.place(list(range(100, 132)))
    assert placement is not None and placement.remote_ttft_ms == pytest.approx(1.6 + 3.0)
    idle = conditional_pool(served_model, p_queued_tokens=0)
    idle.report("d", **(DECODE_LOAD | {"running_requests": 0}))
    placement = idle.router.place(list(range(100, 132)))
    assert placement is not None and placement.remote_ttft_ms == pytest.approx(1.6 + 3.0)


def test_local_first_keeps_short_prompts_off_an_idle_prefill_worker(served_model: ServedModel) -> None:
    """--local-first-ttft-ms: P idle is sooner for a chat (14.6 ms against D's 31.6), but D's estimate
    is within the bound, so the chat stays on D and P's time stays with the long prompts; over the
    bound, too long or over the TPOT target, the lower estimate and the guards decide as before."""
    short = list(range(100, 132))
    for bound, path in ((40.0, LOCAL), (30.0, REMOTE), (0.0, REMOTE)):
        pool = Pool(served_model, RoutingPolicy("conditional", 256, local_first_ttft_ms=bound))
        pool.add("p", "prefill")
        pool.add("d", "decode", num_blocks=1000)
        pool.report("p", us_per_token=50.0)
        pool.report("d", **DECODE_LOAD)
        placement = pool.router.place(short)
        assert placement is not None and placement.path == path, bound
        assert placement.local_ttft_ms == pytest.approx(31.6) and placement.remote_ttft_ms == pytest.approx(
            14.6
        )
        assert placement.routing().local_first_ttft_ms == bound
        long_prompt = pool.router.place(list(range(300)))  # 300 uncached tokens > 256
        assert long_prompt is not None and long_prompt.path == REMOTE
    guarded = Pool(served_model, RoutingPolicy("conditional", tpot_slo_ms=21.0, local_first_ttft_ms=1e6))
    guarded.add("p", "prefill")
    guarded.add("d", "decode", num_blocks=1000)
    guarded.report("p", us_per_token=50.0)
    guarded.report("d", **DECODE_LOAD)
    running = [RunningDecode(10, 11)] * 8
    placement = guarded.router.place(list(range(100, 400)), lambda worker_id: running)
    assert placement is not None and placement.path == REMOTE and placement.local_tpot_ms > 21.0


def test_long_prompt_goes_to_the_prefill_worker_however_queued(served_model: ServedModel) -> None:
    pool = conditional_pool(served_model, p_queued_tokens=100_000)  # 5 s of queue on P
    placement = pool.router.place(list(range(300)))  # 300 uncached tokens > the 256-token limit
    assert placement is not None and placement.path == REMOTE and placement.decode.worker_id == "d"
    assert 0 < placement.local_ttft_ms < placement.remote_ttft_ms  # cheaper, but it would hold D


@pytest.mark.parametrize(
    ("target", "threshold", "path"),
    [(250.0, 128, REMOTE), (200.0, 128, LOCAL), (0.0, 128, LOCAL), (250.0, 0, LOCAL), (250.0, 512, LOCAL)],
    ids=["remote-meets-target", "remote-misses-target", "no-target", "no-threshold", "short-for-d"],
)
def test_a_long_prompt_holds_the_decode_worker_only_to_save_the_ttft_target(
    served_model: ServedModel, target: float, threshold: int, path: int
) -> None:
    """--ttft-slo-ms: a 300-token prompt, long by D's threshold, costs D about 145 ms and P 228 (200 ms
    of queue): it goes to P while P's estimate is within the target, and to D once it is not; a prompt
    D would not chunk as long (no threshold, or one above it) is priced as before."""
    pool = Pool(served_model, RoutingPolicy("conditional", 2048, ttft_slo_ms=target))
    pool.add("p", "prefill")
    pool.add("d", "decode", num_blocks=1000)
    pool.report("p", queued_tokens=4000, us_per_token=50.0)
    pool.report("d", long_prefill_token_threshold=threshold, **DECODE_LOAD)
    placement = pool.router.place(list(range(300)))
    assert placement is not None and placement.path == path
    assert placement.local_ttft_ms < placement.remote_ttft_ms == pytest.approx(200.0 + 15.0 + 3.0 + 10.0)
    assert placement.routing().ttft_target_ms == target
    short = pool.router.place(list(range(100, 132)))  # a chat is never held to the target
    assert short is not None and short.path == LOCAL


def test_without_a_prefill_worker_with_room_only_short_prompts_run_on_the_decode_worker(
    served_model: ServedModel,
) -> None:
    pool = conditional_pool(served_model, p_queued_tokens=0)
    pool.registry.sweep(now=10.0)  # both silent past the bound; only D heartbeats again
    pool.report("d", now=10.0, **DECODE_LOAD)
    short = pool.router.place(list(range(16)))
    assert short is not None and short.path == LOCAL and short.remote_ttft_ms == 0.0
    assert pool.router.place(list(range(300))) is None  # waits for a prefill worker, never holds D


def test_mostly_cached_prompt_skips_the_hop(served_model: ServedModel) -> None:
    """A follow-up turn whose history D decoded: 992 of its 1,000 tokens are in D's prefix cache."""
    prompt = [t % 700 for t in range(1000)]
    pool = conditional_pool(served_model, p_queued_tokens=0)
    pool.report("d", stored=prefix_block_hashes(prompt, 16, pool.model.identity), **DECODE_LOAD)
    placement = pool.router.place(prompt)
    assert placement is not None and placement.path == LOCAL
    assert (placement.cached_tokens, placement.uncached_tokens) == (992, 8)
    assert placement.remote_ttft_ms == pytest.approx(1000 * 0.05 + 3.0 + 10.0)  # P has none of it


def test_step_base_counts_once_per_step_of_the_budget(served_model: ServedModel) -> None:
    """P measured as 100 ms a step + 1.5 ms a token, 32 tokens a step: 300 queued + 64 new tokens
    are 12 steps. D (idle, same cost) prefills the 64 tokens in 2 steps of its 100 ms decode step."""
    pool = Pool(served_model, RoutingPolicy("conditional"))
    pool.add("p", "prefill")
    pool.add("d", "decode", num_blocks=1000)
    step = {"step_token_budget": 32, "step_base_ms": 100.0}
    pool.report("p", queued_tokens=300, us_per_token=1500.0, **step)
    pool.report("d", us_per_token=1500.0, decode_step_ms=100.0, **step)
    placement = pool.router.place(list(range(64)))
    assert placement is not None and placement.path == LOCAL
    assert placement.prefill_queue_ms == pytest.approx(300 * 1.5 + 10 * 100.0)
    assert placement.remote_ttft_ms == pytest.approx(364 * 1.5 + 12 * 100.0)
    assert placement.local_ttft_ms == pytest.approx(64 * 1.5 + 2 * 100.0)


def test_no_spare_step_budget_means_no_local_prefill(served_model: ServedModel) -> None:
    pool = conditional_pool(served_model, p_queued_tokens=4000)
    pool.report("d", **(DECODE_LOAD | {"running_requests": 64}))  # the decodes take the whole budget
    placement = pool.router.place(list(range(16)))
    assert placement is not None and placement.path == REMOTE and placement.decode_spare_tokens == 0


def test_placed_local_work_counts_against_the_next_local_estimate(served_model: ServedModel) -> None:
    pool = conditional_pool(served_model, p_queued_tokens=4000)  # remote: 200 + 10 + 3 + 10 ms
    first = pool.router.place(list(range(200)))
    assert first is not None and first.path == LOCAL
    assert first.local_ttft_ms == pytest.approx(
        200 * 0.05 + 4 * 20.0 + 10.0
    )  # 4 steps of 56 spare, + half one
    pool.router.commit(first)
    second = pool.router.place(list(range(300, 500)))  # behind the first: 400 tokens, 8 steps
    assert second is not None and second.local_ttft_ms == pytest.approx(400 * 0.05 + 8 * 20.0 + 10.0)


def test_the_local_estimate_prices_prompt_tokens_at_cost_beside_decodes(served_model: ServedModel) -> None:
    """D reports what prompt tokens add beside its decodes (2 ms a step that carries any, 100 us a
    token): the local estimate uses that fit, not its whole-step cost, and the TPOT projection too."""
    pool = conditional_pool(served_model, p_queued_tokens=4000)
    beside = {"prompt_beside_decodes_us_per_token": 100.0, "prompt_beside_decodes_base_ms": 2.0}
    pool.report("d", us_per_token=50.0, **(DECODE_LOAD | beside))
    placement = pool.router.place(list(range(200)))  # 4 steps of 56 spare
    assert placement is not None and placement.path == LOCAL
    assert placement.local_ttft_ms == pytest.approx(200 * 0.1 + 4 * 2.0 + 4 * 20.0 + 10.0)
    tpot_pool = Pool(served_model, RoutingPolicy("conditional", 256, tpot_slo_ms=80.0))
    tpot_pool.add("p", "prefill")
    tpot_pool.add("d", "decode", num_blocks=1000)
    tpot_pool.report("p", queued_tokens=4000, us_per_token=50.0)
    tpot_pool.report("d", us_per_token=50.0, **(DECODE_LOAD | beside))
    guarded = tpot_pool.router.place(list(range(200)), lambda wid: [RunningDecode(60, 64)])
    assert guarded is not None and guarded.path == LOCAL
    assert guarded.local_added_ms == pytest.approx(200 * 0.1 + 4 * 2.0)
    assert guarded.local_tpot_ms == pytest.approx(20.0 + 28.0 / 63)


def test_a_short_prompt_is_priced_on_borrowed_cores_while_no_prefill_worker_has_work(
    served_model: ServedModel,
) -> None:
    """D also reports its prompt fit on borrowed cores (1 ms a step, 40 us a token, against 2 ms and
    100 us on its own) and the prompt tokens its time cap buys a step there (48, against 16): while
    P has nothing queued, a short prompt on D is priced by them; a long one (over D's threshold,
    128) keeps D's own, and so does any prompt while P has work."""
    pool = conditional_pool(served_model, p_queued_tokens=0)
    d_load = DECODE_LOAD | D_BORROWED_FIT
    pool.report("d", us_per_token=50.0, **d_load)
    short, long = list(range(48)), list(range(200))
    placement = pool.router.place(short)  # one step of 48
    assert placement is not None and placement.local_on_borrowed_cores
    assert placement.local_ttft_ms == pytest.approx(48 * 0.04 + 1.0 + 20.0 + 10.0)
    assert placement.decode_spare_tokens == 48 and placement.routing().local_on_borrowed_cores
    placement = pool.router.place(long)
    assert placement is not None and not placement.local_on_borrowed_cores
    pool.report("p", queued_tokens=64, us_per_token=50.0)  # P computes: its cores are its own
    placement = pool.router.place(short)  # three steps of 16
    assert placement is not None and not placement.local_on_borrowed_cores
    assert placement.local_ttft_ms == pytest.approx(48 * 0.1 + 3 * 2.0 + 3 * 20.0 + 10.0)
    pool.report("p", us_per_token=50.0)
    pool.router.commit(pool.router.place(long) or pytest.fail("no placement"))  # placed on P since
    placement = pool.router.place(short)
    assert placement is not None and not placement.local_on_borrowed_cores


def test_an_idle_prefill_worker_is_priced_behind_the_borrowed_step_it_must_wait_out(
    served_model: ServedModel,
) -> None:
    """While D has a short prompt placed on the borrowed cores, an idle P's estimate begins with that
    step (48 tokens at 40 us + 1 ms, and a 20 ms decode step): its claim waits for it, one step as D
    cuts it (its cap there, or a short prompt whole). D's long prompts (computed at home) cost P
    nothing, nor does anything once P has work of its own (its cores are then its own, D computes at
    home)."""
    pool = conditional_pool(served_model, p_queued_tokens=0)
    d_load = DECODE_LOAD | D_BORROWED_FIT
    pool.report("d", us_per_token=50.0, **d_load)
    pool.report("p", us_per_token=1000.0)  # 48 ms for the chat: D's 32.9 on borrowed cores wins
    first = pool.router.place(list(range(48)))
    assert first is not None and first.path == LOCAL and first.local_on_borrowed_cores
    assert pool.router.claim_wait_ms() == 0.0
    pool.router.commit(first)
    assert pool.router.claim_wait_ms() == pytest.approx(48 * 0.04 + 1.0 + 20.0)
    second = pool.router.place(list(range(1000, 1048)))
    assert second is not None
    assert second.remote_ttft_ms == pytest.approx(first.remote_ttft_ms + 48 * 0.04 + 1.0 + 20.0)
    assert second.prefill_queue_ms == pytest.approx(48 * 0.04 + 1.0 + 20.0)
    pool.report("d", us_per_token=50.0, queued_tokens=200, queued_long_tokens=200, **d_load)
    assert pool.router.claim_wait_ms() == 0.0  # a long prompt's chunks stay on D's own cores
    pool.report("d", us_per_token=50.0, queued_tokens=96, **d_load)
    assert pool.router.claim_wait_ms() == pytest.approx(48 * 0.04 + 1.0 + 20.0)  # one step: the cap's 48
    whole = d_load | {"short_prompts_whole": True}
    pool.report("d", us_per_token=50.0, queued_tokens=50, **whole)
    assert pool.router.claim_wait_ms() == pytest.approx(50 * 0.04 + 1.0 + 20.0)  # whole: all 50
    pool.report("p", queued_tokens=64, us_per_token=1000.0)
    assert pool.router.claim_wait_ms() == 0.0


def test_a_decode_worker_that_runs_short_prompts_whole_is_priced_one_step_for_them(
    served_model: ServedModel,
) -> None:
    """D caps prompt tokens beside its decodes at 16 but runs short prompts whole (threshold 128): a
    48-token chat is one step of the 56 its decodes leave, not three of 16; a 200-token prompt's
    chunks stay capped, and so do a 400-token prompt's last 48 when D has the rest cached."""
    pool = conditional_pool(served_model, p_queued_tokens=4000)
    home = D_HOME_FIT
    short, long = list(range(48)), list(range(200))
    for whole, steps in ((False, 3), (True, 1)):
        pool.report("d", us_per_token=50.0, short_prompts_whole=whole, **(DECODE_LOAD | home))
        placement = pool.router.place(short)
        assert placement is not None and placement.path == LOCAL
        assert placement.decode_spare_tokens == (56 if whole else 16)
        assert placement.local_ttft_ms == pytest.approx(48 * 0.1 + steps * 2.0 + steps * 20.0 + 10.0)
        placement = pool.router.place(long)
        assert placement is not None and placement.decode_spare_tokens == 16
    # long by its whole length, as D's scheduler judges it, however much of it D has cached: its 48
    # uncached tokens run capped there, so they are priced capped
    cached = list(range(400))
    pool.report(
        "d", us_per_token=50.0, short_prompts_whole=True,
        stored=prefix_block_hashes(cached, 16, pool.model.identity)[:22], **(DECODE_LOAD | home),
    )  # fmt: skip
    placement = pool.router.place(cached)
    assert placement is not None and placement.uncached_tokens == 48
    assert placement.decode_spare_tokens == 16


def test_before_its_first_borrowed_step_a_decode_worker_is_priced_at_its_share_of_the_team(
    served_model: ServedModel,
) -> None:
    """D borrows one CPU beside its one thread (share 0.5) but has not measured a step there: a short
    prompt is priced at its home fit x 0.5 (48 x 100 us + 3 x 2 ms, halved) with its home cap, so an
    idle P no longer takes every chat and D gets to measure; without a share, the home price."""
    pool = conditional_pool(served_model, p_queued_tokens=0)
    home = D_HOME_FIT | {"prefill_tokens_while_decoding_on_borrowed_cores": 16}
    pool.report("d", us_per_token=50.0, **(DECODE_LOAD | home))
    short = list(range(48))
    placement = pool.router.place(short)
    assert placement is not None and not placement.local_on_borrowed_cores
    assert placement.local_ttft_ms == pytest.approx(48 * 0.1 + 3 * 2.0 + 3 * 20.0 + 10.0)
    pool.report("d", us_per_token=50.0, prompt_on_borrowed_cores_share=0.5, **(DECODE_LOAD | home))
    placement = pool.router.place(short)
    assert placement is not None and placement.local_on_borrowed_cores
    assert placement.local_ttft_ms == pytest.approx((48 * 0.1 + 3 * 2.0) * 0.5 + 3 * 20.0 + 10.0)


@pytest.mark.parametrize(("mode", "path"), [("always", REMOTE), ("never", LOCAL)], ids=["always", "never"])
def test_always_and_never_ignore_the_estimates(served_model: ServedModel, mode: str, path: int) -> None:
    pool = Pool(served_model, RoutingPolicy(mode))
    pool.add("p", "prefill")
    pool.add("d", "decode", num_blocks=1000)
    pool.report("d", **DECODE_LOAD)
    for prompt in (list(range(8)), list(range(2000))):
        placement = pool.router.place(prompt)
        assert placement is not None and placement.path == path


def test_bad_policy_names_the_flag() -> None:
    with pytest.raises(ValueError, match="--disaggregation must be one of always, never, conditional"):
        RoutingPolicy("sometimes")
    with pytest.raises(ValueError, match="--local-prefill-max-tokens"):
        RoutingPolicy("conditional", -1)
    with pytest.raises(ValueError, match="--local-first-ttft-ms must be >= 0"):
        RoutingPolicy("conditional", local_first_ttft_ms=float("nan"))
    with pytest.raises(ValueError, match="--ttft-slo-ms must be >= 0"):
        RoutingPolicy("conditional", ttft_slo_ms=-1.0)


@pytest.fixture(scope="module")
def tiny_us_per_token(tiny_model_dir: Callable[[str], Path]) -> float:
    """What the tiny model's prefill costs per token on this machine (one 512-token step)."""
    engine = LLMEngine(load_model(tiny_model_dir("llama-2l")), EngineConfig(num_blocks=64))
    engine.add_request("warm", list(range(5, 69)), SamplingParams(max_tokens=1))
    engine.step()
    engine.add_request("m", list(range(5, 517)), SamplingParams(max_tokens=1))
    start = time.perf_counter()
    engine.step()
    return (time.perf_counter() - start) * 1e6 / 512


@pytest.mark.parametrize("queued_ms", [450.0, 100.0], ids=["long-queue-loses", "short-queue-wins"])
def test_the_cache_hit_that_loses_scaled_to_the_tiny_model(
    served_model: ServedModel, tiny_us_per_token: float, queued_ms: float
) -> None:
    """Seed 001 at the tiny model's measured cost c: idle B recomputes all 6,000 tokens in "240 ms"
    (6,000 c); A holds 4,000 of them behind "450 ms" of queued prefill (scaled by the same factor), so
    A's first token costs 450 + 80 scaled ms and B wins; behind "100 ms" A costs 180 and wins."""
    c = tiny_us_per_token
    scale = 6000 * c / 1e3 / 240.0  # tiny-model ms per seed-ms
    prompt = [t % 1000 for t in range(6000)]
    hashes = prefix_block_hashes(prompt, 16, served_model.identity)
    pool = Pool(served_model)
    pool.add("a", "prefill")
    pool.add("b", "prefill")
    pool.add("d", "decode", num_blocks=1000)
    queued = round(queued_ms * scale * 1e3 / c)
    pool.report("a", queued_tokens=queued, us_per_token=c, stored=hashes[: 4000 // 16])
    pool.report("b", us_per_token=c)
    ttft_a, cached = pool.router.estimate_ttft(pool.registry.get("a"), prompt)  # type: ignore[arg-type]
    assert cached == 4000 and ttft_a == pytest.approx((queued_ms + 80.0) * scale, rel=1e-3)
    ttft_b, _ = pool.router.estimate_ttft(pool.registry.get("b"), prompt)  # type: ignore[arg-type]
    assert ttft_b == pytest.approx(240.0 * scale)
    placement = pool.router.place(prompt)
    assert placement is not None
    assert placement.prefill.worker_id == ("b" if queued_ms == 450.0 else "a")
    assert placement.cached_tokens == (0 if queued_ms == 450.0 else 4000)


def test_a_chat_goes_to_a_prefill_worker_whose_queue_it_passes(served_model: ServedModel) -> None:
    # P queues one 4,000-token document (200 ms FIFO) but runs --long-prefill-token-threshold 128:
    # a 32-token chat waits out half the document's 128-token chunk in flight (3.2 ms), then goes
    # first in the next step beside one 16-token block of the document (2.4 ms), and with the hop (3 ms,
    # and half D's 20 ms step before token 1 streams from D) beats D's step in flight and its next one
    pool = conditional_pool(served_model, p_queued_tokens=4000)
    pool.report(
        "p", queued_tokens=4000, queued_long_tokens=4000, long_prefill_token_threshold=128,
        step_token_budget=512, us_per_token=50.0,
    )  # fmt: skip
    placement = pool.router.place(list(range(100, 132)))
    assert placement is not None and placement.path == REMOTE and placement.prefill.worker_id == "p"
    assert placement.remote_ttft_ms == pytest.approx(64 * 0.05 + 48 * 0.05 + 3.0 + 10.0)
    assert placement.local_ttft_ms == pytest.approx(1.6 + 20.0 + 10.0)


def test_a_chat_on_the_decode_worker_is_priced_before_the_document_prefilling_there(
    served_model: ServedModel,
) -> None:
    """D prefills a 1,000-token document beside two decodes, 27 prompt tokens a step (its time cap),
    threshold 128: a 64-token chat goes before the document there (engine.scheduler's order), so its
    local estimate is its own 64 tokens and 15 of the document's in 3 steps (13, half the step the
    chat joins, then 2 of the 4 it leaves in its last), at 1 ms a token and 2 ms a step beside the
    decodes and 15 ms each decode step, after the step in flight (half of 15 ms and half of a
    27-token chunk): 152 ms, not the 1.7 s of queueing behind the document's tokens. P, prefilling
    its own document under threshold 256, would take 278 ms: the chat stays on D."""
    pool = document_on_p_pool(served_model)
    document = {"queued_tokens": 1000, "queued_long_tokens": 1000, "long_prefill_token_threshold": 128}
    pool.report(
        "d", step_token_budget=512, running_requests=3, prefill_tokens_while_decoding=27,
        decode_step_ms=15.0, kv_transfer_ms=3.0, prompt_beside_decodes_us_per_token=1000.0,
        prompt_beside_decodes_base_ms=2.0, **document,
    )  # fmt: skip
    chat = list(range(64))
    placement = pool.router.place(chat)
    assert placement is not None and placement.path == LOCAL
    assert placement.local_ttft_ms == pytest.approx(79 * 1.0 + 3 * 2.0 + 3 * 15.0 + 7.5 + (27 + 2.0) / 2)
    # P: half its 256-token chunk in flight, then the chat and a 16-token block of the document in
    # one step, the transfer, and half D's step before token 1 streams from D
    assert placement.remote_ttft_ms == pytest.approx((5 + 320) / 2 + 80 * 1.25 + 5 + 3.0 + 7.5)
    pool.report(
        "d", step_token_budget=512, running_requests=3, prefill_tokens_while_decoding=27,
        decode_step_ms=15.0, kv_transfer_ms=3.0, prompt_beside_decodes_us_per_token=1000.0,
        prompt_beside_decodes_base_ms=2.0, queued_tokens=1000,
    )  # fmt: skip
    fifo = pool.router.place(chat)  # no threshold on D: the chat waits for the document's tokens
    assert fifo is not None and fifo.path == REMOTE
    assert fifo.local_ttft_ms == pytest.approx(1064 + 40 * 2.0 + 40 * 15.0 + 7.5)
