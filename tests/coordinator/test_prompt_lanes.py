"""Prompt lanes: a prefill worker with `--max-prompt-tokens` takes only sequences that short, one at
`--cpu-priority idle` (SCHED_IDLE) only what no normal-priority prefill worker takes, and the work of
an idle-priority worker never keeps a decode worker off the cores it borrows (it yields them)."""

from __future__ import annotations

from coordinator.router import LOCAL, REMOTE, Placement
from coordinator.routing_policy import RoutingPolicy
from coordinator.served_model import ServedModel
from tests.coordinator.conftest import Pool

CAP = 64
CHAT = list(range(100, 132))  # 32 tokens: the short lane's
DOC = list(range(100, 400))  # 300 tokens: over its cap


def lanes_pool(served_model: ServedModel, policy: RoutingPolicy | None = None) -> Pool:
    """A long lane "p-long" (idle priority, any length) and a short one "p-short" (at most CAP tokens)
    on the same cores, both reporting 1 ms a token, and a decode worker with room."""
    pool = Pool(served_model, policy)
    pool.add("p-long", "prefill", idle_priority=True)
    pool.add("p-short", "prefill", max_prompt_tokens=CAP)
    pool.add("d", "decode", num_blocks=1000)
    return pool


def place(pool: Pool, tokens: list[int]) -> Placement:
    placement = pool.router.place(tokens)
    assert placement is not None
    return placement


def test_a_short_prompt_goes_to_the_short_lane_even_when_the_idle_lane_is_estimated_sooner(
    served_model: ServedModel,
) -> None:
    pool = lanes_pool(served_model)
    pool.report("p-long", us_per_token=1000.0)  # idle: 32 ms for the chat
    pool.report("p-short", queued_tokens=40, us_per_token=1000.0)  # 72 ms
    chat = place(pool, CHAT)
    assert chat.path == REMOTE and chat.prefill.worker_id == "p-short"
    assert chat.remote_ttft_ms > pool.router.estimate_ttft(pool.registry.get("p-long"), CHAT)[0]  # type: ignore[arg-type]


def test_a_prompt_over_the_short_lanes_cap_goes_to_the_idle_priority_lane(served_model: ServedModel) -> None:
    pool = lanes_pool(served_model)
    pool.report("p-long", queued_tokens=1000, us_per_token=1000.0)  # a second of queue
    pool.report("p-short", us_per_token=1000.0)  # idle
    assert place(pool, DOC).prefill.worker_id == "p-long"
    assert place(pool, DOC[:CAP]).prefill.worker_id == "p-short"  # exactly the cap: the short lane's


def test_a_prompt_no_lane_takes_waits(served_model: ServedModel) -> None:
    pool = Pool(served_model)
    pool.add("p-short", "prefill", max_prompt_tokens=CAP)
    pool.add("d", "decode", num_blocks=1000)
    assert pool.router.place(DOC) is None
    assert place(pool, CHAT).prefill.worker_id == "p-short"


def test_an_idle_priority_lanes_work_leaves_its_cores_to_the_decode_worker(
    served_model: ServedModel,
) -> None:
    """D borrows the prefill CPUs for a chat while only the idle-priority lane has work (the kernel
    runs D's thread first there); not while the short lane, which lends them, has any."""
    pool = lanes_pool(served_model, RoutingPolicy("conditional"))
    load = {"step_token_budget": 512, "decode_step_ms": 10.0, "prompt_on_borrowed_cores_share": 0.5}
    pool.report("d", us_per_token=1000.0, **load)
    pool.report("p-long", queued_tokens=1000, us_per_token=1000.0)
    pool.report("p-short", us_per_token=1000.0)
    d = pool.registry.get("d")
    assert d is not None
    assert pool.router.on_borrowed_cores(d, len(CHAT))
    chat = place(pool, CHAT)
    assert chat.path == LOCAL and chat.routing().local_on_borrowed_cores

    pool.report("p-short", queued_tokens=40, us_per_token=1000.0)
    assert not pool.router.on_borrowed_cores(d, len(CHAT))
