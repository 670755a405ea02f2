"""The TPOT a local prefill costs the decode worker (`--tpot-slo-ms`): conditional disaggregation
prefills on D only while the projected TPOT of D's running requests stays within the target, so the
decision flips on D's load, both ways, and on how the added step time spreads over their tokens."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from coordinator.admission import AdmittedRequest
from coordinator.dispatch import Dispatcher
from coordinator.metrics import CoordinatorMetrics
from coordinator.request_table import RequestTable
from coordinator.router import LOCAL, REMOTE, Placement, RunningDecode
from coordinator.routing_policy import RoutingPolicy
from coordinator.served_model import ServedModel
from engine.sampling_params import SamplingParams
from tests.coordinator.conftest import Pool

TARGET_MS = 80.0
SHORT = list(range(100, 132))  # 32 uncached tokens
# D: 64 tokens a step, 8 running decodes (56 spare), 0 ms of exposed transfer
D_LOAD = {"step_token_budget": 64, "running_requests": 8}


def guarded_pool(
    served_model: ServedModel, *, p_queued: int, target: float = TARGET_MS, guard: str = "ceiling"
) -> Pool:
    pool = Pool(served_model, RoutingPolicy("conditional", 512, tpot_slo_ms=target, tpot_guard=guard))
    pool.add("p", "prefill")
    pool.add("d", "decode", num_blocks=1000)
    pool.report("p", queued_tokens=p_queued, us_per_token=50.0)
    return pool


def running(n: int, remaining: int, total: int) -> Sequence[RunningDecode]:
    return [RunningDecode(remaining, total)] * n


def test_the_decision_follows_the_decode_workers_step_time_both_ways(served_model: ServedModel) -> None:
    pool = guarded_pool(served_model, p_queued=4000)  # 200 ms of queue on P: local wins on TTFT
    on_d = running(8, 60, 64)

    def place() -> Placement | None:
        return pool.router.place(SHORT, lambda wid: on_d if wid == "d" else ())

    pool.report("d", decode_step_ms=20.0, **D_LOAD)
    light = place()
    assert light is not None and light.path == LOCAL
    # 32 x 50 us = 1.6 ms of added step time, all inside every running request's remaining steps
    assert light.local_added_ms == pytest.approx(1.6)
    assert light.local_tpot_ms == pytest.approx(20.0 + 1.6 / 63)
    routing = light.routing()
    assert (routing.tpot_target_ms, routing.decode_running) == (TARGET_MS, 8)

    pool.report("d", decode_step_ms=85.0, **D_LOAD)  # D's decodes alone are over the target now
    heavy = place()
    assert heavy is not None and heavy.path == REMOTE
    assert heavy.local_tpot_ms > TARGET_MS and heavy.local_ttft_ms < heavy.remote_ttft_ms
    assert heavy.routing().local_tpot_ms == pytest.approx(85.0 + 1.6 / 63)

    pool.report("d", decode_step_ms=20.0, **D_LOAD)  # and back once D's step time falls
    again = place()
    assert again is not None and again.path == LOCAL


def test_the_added_step_time_spreads_over_the_running_requests_tokens(served_model: ServedModel) -> None:
    """D costs 1 ms a token and has 3,000 local prefill tokens queued: the prompt's local work is
    3,032 ms of step time. A request with 60 of 64 tokens to go absorbs all of it over 63 gaps; a
    request with 2 tokens to go of 2 takes 2 x 56 tokens of it in one gap."""
    pool = guarded_pool(served_model, p_queued=200_000)  # 10 s of queue on P
    pool.report(
        "d", queued_tokens=3000, prompt_beside_decodes_us_per_token=1000.0, decode_step_ms=20.0, **D_LOAD
    )

    long_tail = pool.router.place(SHORT, lambda wid: running(1, 60, 64))
    assert long_tail is not None and long_tail.path == LOCAL
    assert long_tail.local_added_ms == pytest.approx(3032.0)
    assert long_tail.local_tpot_ms == pytest.approx(20.0 + 3032.0 / 63)

    short_tail = pool.router.place(SHORT, lambda wid: running(1, 2, 2))
    assert short_tail is not None and short_tail.path == REMOTE
    assert short_tail.local_tpot_ms == pytest.approx(20.0 + 2 * 56 * 1.0)


def test_the_projection_uses_the_prefill_budget_d_applies_beside_decodes(served_model: ServedModel) -> None:
    """D reports --prefill-tokens-while-decoding 8: with 8 decodes running, the local prefill gets 8
    tokens a step (not the 56 the budget leaves), so its TTFT counts 4 steps for 32 tokens (after half
    the step in flight) and a
    request with 2 tokens to go sees 2 x 8 of them; with nothing running the cap does not apply."""
    pool = guarded_pool(served_model, p_queued=200_000)
    pool.report(
        "d",
        prompt_beside_decodes_us_per_token=1000.0,
        decode_step_ms=20.0,
        prefill_tokens_while_decoding=8,
        **D_LOAD,
    )
    placement = pool.router.place(SHORT, lambda wid: running(1, 2, 2))
    assert placement is not None and placement.decode_spare_tokens == 8
    assert placement.local_ttft_ms == pytest.approx(32 * 1.0 + 4 * 20.0 + 10.0)
    assert placement.local_tpot_ms == pytest.approx(20.0 + 2 * 8 * 1.0)
    idle = {**D_LOAD, "running_requests": 0}
    pool.report(
        "d",
        prompt_beside_decodes_us_per_token=1000.0,
        decode_step_ms=20.0,
        prefill_tokens_while_decoding=8,
        **idle,
    )
    alone = pool.router.place(SHORT)
    assert alone is not None and alone.decode_spare_tokens == 64
    assert alone.local_ttft_ms == pytest.approx(32 * 1.0 + 20.0)  # idle: no step in flight to wait out


def test_the_increment_guard_refuses_only_what_pushes_a_request_over(served_model: ServedModel) -> None:
    """`--tpot-guard increment`: with D's step alone over the target nobody can be pushed over it, so
    the short prompt goes local (the ceiling guard sends it to P); with D at 79 ms and 2 ms a token,
    its 32 tokens (64 ms over 63 gaps: +1.0 ms) push the 64-token requests over 80 ms, so it goes to P."""
    pool = guarded_pool(served_model, p_queued=4000, guard="increment")
    on_d = running(8, 60, 64)
    pool.report("d", decode_step_ms=85.0, **D_LOAD)
    over = pool.router.place(SHORT, lambda wid: on_d)
    assert over is not None and over.path == LOCAL and over.local_tpot_ms > TARGET_MS
    pool.report("d", prompt_beside_decodes_us_per_token=2000.0, decode_step_ms=79.5, **D_LOAD)
    pushes = pool.router.place(SHORT, lambda wid: on_d)
    assert pushes is not None and pushes.path == REMOTE and pushes.local_pushed_over == 8
    pool.report("d", prompt_beside_decodes_us_per_token=2000.0, decode_step_ms=70.0, **D_LOAD)
    room = pool.router.place(SHORT, lambda wid: on_d)
    assert room is not None and room.path == LOCAL and room.local_pushed_over == 0
    with pytest.raises(ValueError, match="--tpot-guard"):
        RoutingPolicy("conditional", tpot_guard="loose")


def test_nothing_decoding_costs_no_tpot(served_model: ServedModel) -> None:
    pool = guarded_pool(served_model, p_queued=4000)
    pool.report("d", decode_step_ms=20.0, **D_LOAD)
    placement = pool.router.place(SHORT)  # the default: no running requests known
    assert placement is not None and placement.path == LOCAL
    assert (placement.local_tpot_ms, placement.decode_running) == (0.0, 0)


def test_without_a_target_ttft_alone_decides(served_model: ServedModel) -> None:
    pool = guarded_pool(served_model, p_queued=4000, target=0.0)
    pool.report("d", decode_step_ms=85.0, **D_LOAD)
    placement = pool.router.place(SHORT, lambda wid: running(8, 60, 64))
    assert placement is not None and placement.path == LOCAL
    assert (placement.local_tpot_ms, placement.tpot_target_ms) == (0.0, 0.0)


def test_over_the_target_with_no_prefill_worker_waits(served_model: ServedModel) -> None:
    pool = guarded_pool(served_model, p_queued=0)
    pool.registry.sweep(now=10.0)  # P silent past the staleness bound; only D heartbeats again
    pool.report("d", now=10.0, decode_step_ms=85.0, **D_LOAD)
    assert pool.router.place(SHORT, lambda wid: running(8, 60, 64)) is None
    pool.report("d", now=10.0, decode_step_ms=20.0, **D_LOAD)
    placement = pool.router.place(SHORT, lambda wid: running(8, 60, 64))
    assert placement is not None and placement.path == LOCAL


def test_a_bad_target_names_the_flag() -> None:
    with pytest.raises(ValueError, match="--tpot-slo-ms"):
        RoutingPolicy("conditional", tpot_slo_ms=-1.0)


def test_the_dispatcher_counts_the_requests_it_placed_on_d(served_model: ServedModel) -> None:
    """Through the dispatcher: the first short prompt goes local (nothing decodes on D yet); the
    second would add its own and the first's prefill (400 tokens x 2 ms) to D's 70 ms steps, spread
    over the first's 63 gaps: 82.7 ms, over the 80 ms target, so it goes to P."""
    pool = guarded_pool(served_model, p_queued=1_000_000)  # 50 s of queue on P
    pool.report("d", prompt_beside_decodes_us_per_token=2000.0, decode_step_ms=70.0, **D_LOAD)
    metrics = CoordinatorMetrics()
    dispatcher = Dispatcher(
        RequestTable(metrics, rid_start=0), pool.registry, pool.router, metrics, lambda *_: None, max_queue=4
    )
    prompts = [[5 + (i + k) % 900 for i in range(200)] for k in (0, 1)]
    first, second = (
        dispatcher.submit(AdmittedRequest(f"r{k}", served_model, p, SamplingParams(max_tokens=64, seed=1)))
        for k, p in enumerate(prompts)
    )
    assert first.stats.routing is not None and first.stats.routing.path == LOCAL
    assert first.stats.routing.decode_running == 0
    routing = second.stats.routing
    assert routing is not None and routing.path == REMOTE and routing.decode_running == 1
    assert routing.local_tpot_ms == pytest.approx(70.0 + 400 * 2.0 / 63)
