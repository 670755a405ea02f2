"""The gap a local prefill makes (`--itl-stretch`): conditional disaggregation prefills on a decoding D
only while the step carrying the prompt stays within a multiple of D's decode step; a prompt that
would stretch the running requests' next gap further goes to P, unless P's estimate is over the TTFT
target. An idle D has no gap to stretch and still prefills short prompts itself."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from coordinator.router import LOCAL, REMOTE, Placement, RunningDecode
from coordinator.routing_policy import RoutingPolicy
from coordinator.served_model import ServedModel
from tests.coordinator.conftest import Pool

STEP_MS = 15.0
# D: 64 tokens a step, a prompt token beside its decodes costs 0.5 ms (a fixed 2 ms a step carrying any)
D_LOAD = {
    "step_token_budget": 64,
    "decode_step_ms": STEP_MS,
    "prompt_beside_decodes_us_per_token": 500.0,
    "prompt_beside_decodes_base_ms": 2.0,
}
CHAT = list(range(100, 132))  # 32 uncached tokens: 2 + 16 ms beside the decodes
SHORT = list(range(100, 108))  # 8: 2 + 4 ms


def stretch_pool(served_model: ServedModel, *, stretch: float, ttft_slo_ms: float = 0.0) -> Pool:
    pool = Pool(served_model, RoutingPolicy("conditional", 512, ttft_slo_ms=ttft_slo_ms, itl_stretch=stretch))
    pool.add("p", "prefill")
    pool.add("d", "decode", num_blocks=1000)
    pool.report("p", queued_tokens=4000, us_per_token=50.0)  # 200 ms of queue: local is sooner
    return pool


def decoding(n: int) -> Sequence[RunningDecode]:
    return [RunningDecode(60, 64)] * n


def place(pool: Pool, tokens: list[int], running: int) -> Placement:
    placement = pool.router.place(tokens, lambda wid: decoding(running) if wid == "d" else ())
    assert placement is not None
    return placement


def test_a_prompt_that_would_stretch_running_gaps_goes_to_the_prefill_worker(
    served_model: ServedModel,
) -> None:
    pool = stretch_pool(served_model, stretch=1.5)
    pool.report("d", running_requests=2, **D_LOAD)
    chat = place(pool, CHAT, running=2)
    # 15 + 2 + 32 x 0.5 = 33 ms > 1.5 x 15: remote, although the local estimate is the lower
    assert chat.path == REMOTE and chat.local_ttft_ms < chat.remote_ttft_ms
    assert chat.local_gap_ms == pytest.approx(33.0)
    routing = chat.routing()
    assert (routing.local_gap_ms, routing.itl_stretch) == (pytest.approx(33.0), 1.5)

    short = place(pool, SHORT, running=2)  # 15 + 2 + 4 = 21 ms: within 22.5, local
    assert short.path == LOCAL and short.local_gap_ms == pytest.approx(21.0)

    pool.report("d", running_requests=0, **D_LOAD)
    idle = place(pool, CHAT, running=0)  # nothing decoding: no gap to stretch
    assert idle.path == LOCAL and idle.local_gap_ms == 0.0


def test_without_the_bound_the_lower_estimate_decides(served_model: ServedModel) -> None:
    pool = stretch_pool(served_model, stretch=0.0)
    pool.report("d", running_requests=2, **D_LOAD)
    chat = place(pool, CHAT, running=2)
    assert chat.path == LOCAL and chat.local_gap_ms == pytest.approx(33.0)


def test_a_remote_estimate_over_the_ttft_target_keeps_the_prompt_local(served_model: ServedModel) -> None:
    """A long gap for the running requests is paid only to save a first token's target: with P's
    200 ms over a 150 ms target the chat stays on D; under a 300 ms target it goes to P."""
    pool = stretch_pool(served_model, stretch=1.5, ttft_slo_ms=150.0)
    pool.report("d", running_requests=2, **D_LOAD)
    saved = place(pool, CHAT, running=2)
    assert saved.path == LOCAL and saved.remote_ttft_ms > 150.0

    pool = stretch_pool(served_model, stretch=1.5, ttft_slo_ms=300.0)
    pool.report("d", running_requests=2, **D_LOAD)
    assert place(pool, CHAT, running=2).path == REMOTE


@pytest.mark.parametrize("stretch", [0.5, -1.0, float("nan")])
def test_a_stretch_below_one_step_is_refused(stretch: float) -> None:
    with pytest.raises(ValueError, match="--itl-stretch must be 0"):
        RoutingPolicy("conditional", itl_stretch=stretch)
