"""The router's choices: decode by free KV blocks, prefill by estimated TTFT with prefix-cache knowledge
(seed 001's "cache hit that loses"), staleness, layout pairing, colocated workers, pending work."""

from __future__ import annotations

import math

import pytest

from coordinator.router import DEFAULT_PREFILL_US_PER_TOKEN, blocks_for, prefix_block_hashes
from coordinator.workers import STALE
from splitserve.v1 import control_pb2, serving_pb2
from tests.coordinator.conftest import Pool


def test_decode_worker_with_the_most_free_blocks_that_fits_wins(pool: Pool) -> None:
    pool.add("p", "prefill")
    pool.add("d1", "decode")
    pool.add("d2", "decode")
    pool.report("d1", free=10)
    pool.report("d2", free=40)
    placement = pool.router.place(list(range(100)))
    assert placement is not None and placement.decode.worker_id == "d2" and placement.prefill.worker_id == "p"
    assert placement.needed_blocks == blocks_for(100, 16) == 7
    pool.report("d2", free=3)
    assert pool.router.place(list(range(100))).decode.worker_id == "d1"  # type: ignore[union-attr]
    pool.report("d1", free=6)  # 6 blocks cannot hold 100 tokens + the next one
    assert pool.router.place(list(range(100))) is None


def test_placed_work_counts_until_the_next_report(pool: Pool) -> None:
    pool.add("p", "prefill")
    pool.add("d1", "decode", num_blocks=20)
    pool.add("d2", "decode", num_blocks=18)
    first = pool.router.place(list(range(100)))
    assert first is not None and first.decode.worker_id == "d1"
    pool.router.commit(first)
    second = pool.router.place(list(range(100)))
    assert second is not None and second.decode.worker_id == "d2"  # d1 has 20 - 7 = 13 left
    assert second.prefill.pending_tokens == 100
    pool.report("d1", free=20)
    assert pool.registry.get("d1").pending_blocks == 0  # type: ignore[union-attr]


def test_the_cache_hit_that_loses_to_an_idle_worker(pool: Pool) -> None:
    """Seed 001: 6,000-token prompt, replica A holds 4,000 tokens of it but has 450 ms of queued prefill;
    idle replica B recomputes everything at 60 us/token (360 ms). B wins; with a short queue, A wins."""
    prompt = [t % 1000 for t in range(6000)]
    hashes = prefix_block_hashes(prompt, 16, pool.model.identity)
    cached_a = hashes[: 4000 // 16]
    pool.add("a", "prefill")
    pool.add("b", "prefill")
    pool.add("d", "decode", num_blocks=1000)
    pool.report("a", queued_tokens=7500, us_per_token=60.0, stored=cached_a)  # 7,500 x 60 us = 450 ms
    pool.report("b", us_per_token=60.0)
    placement = pool.router.place(prompt)
    assert placement is not None and placement.prefill.worker_id == "b"
    assert placement.cached_tokens == 0 and placement.estimated_ttft_ms == pytest.approx(360.0)
    ttft_a, cached = pool.router.estimate_ttft(pool.registry.get("a"), prompt)  # type: ignore[arg-type]
    assert cached == 4000 and ttft_a == pytest.approx(450.0 + 2000 * 0.06)
    pool.report("a", queued_tokens=1000, us_per_token=60.0)  # 60 ms of queue: the hit now pays off
    placement = pool.router.place(prompt)
    assert placement is not None and placement.prefill.worker_id == "a" and placement.cached_tokens == 4000
    assert placement.estimated_ttft_ms == pytest.approx(60.0 + 120.0)


def test_a_lost_heartbeat_forgets_the_prefix_view(pool: Pool) -> None:
    prompt = [t % 500 for t in range(64)]
    hashes = prefix_block_hashes(prompt, 16, pool.model.identity)
    assert len(hashes) == 3  # the last token is never in a cached block
    pool.add("p", "prefill")
    pool.report("p", stored=hashes)
    assert pool.router.estimate_ttft(pool.registry.get("p"), prompt)[1] == 48  # type: ignore[arg-type]
    pool.report("p", seq=5)  # seq 2..4 lost: the partial event stream is not trusted
    assert pool.router.estimate_ttft(pool.registry.get("p"), prompt)[1] == 0  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("prefill_us_per_token", math.nan),
        ("decode_step_ms", math.inf),
        ("kv_transfer_ms", -1.0),
        ("prompt_on_borrowed_cores_share", 2.0),
        ("queued_long_tokens", 9),
    ],
)
def test_a_load_the_router_cannot_price_by_is_refused_and_the_last_one_kept(
    pool: Pool, name: str, value: float
) -> None:
    """A worker's heartbeat still proves it alive, but a load with a NaN, infinite or negative cost,
    a share over 1 or more long tokens than queued ones is not applied (NaN estimates compare false
    both ways): the router keeps pricing by the last sound report until the next one."""
    pool.pair()
    p = pool.registry.get("p")
    assert p is not None
    pool.report("p", queued_tokens=5, us_per_token=50.0)
    bad = {"us_per_token": value} if name == "prefill_us_per_token" else {"us_per_token": 50.0, name: value}
    pool.report("p", queued_tokens=8, now=7.0, **bad)
    assert p.last_seen == 7.0 and p.load.queued_tokens == 5 and p.load.prefill_us_per_token == 50.0
    assert p.load_refused is not None and f"WorkerLoad.{name}" in p.load_refused
    assert pool.router.estimate_ttft(p, list(range(10)))[0] == pytest.approx((5 + 10) * 0.05)
    pool.report("p", queued_tokens=8, us_per_token=50.0)
    assert p.load.queued_tokens == 8 and p.load_refused is None


def test_stale_workers_and_unpaired_layouts_get_no_work(pool: Pool) -> None:
    pool.add("p", "prefill", layout="b")
    pool.add("p2", "prefill", layout="a")
    pool.add("d", "decode", layout="a")
    placement = pool.router.place([1, 2, 3])
    assert placement is not None and placement.prefill.worker_id == "p2"  # p's layout pairs with no decode
    newly = pool.registry.sweep(now=10.0)
    assert {w.worker_id for w in newly} == {"p", "p2", "d"} and pool.registry.get("d").health == STALE  # type: ignore[union-attr]
    assert pool.router.place([1, 2, 3]) is None and not pool.registry.can_serve()
    pool.report("p2", now=10.0)
    pool.report("d", now=10.0)
    assert pool.registry.can_serve() and pool.router.place([1, 2, 3]) is not None


def test_colocated_worker_is_its_own_decode_worker(pool: Pool) -> None:
    pool.add("c", "colocated", num_blocks=8)
    placement = pool.router.place(list(range(50)))
    assert placement is not None and placement.colocated and placement.decode.worker_id == "c"
    assert pool.registry.ready_counts() == (1, 1) and pool.registry.can_serve()
    assert pool.router.place(list(range(200))) is None  # 8 blocks of 16 cannot hold it


def test_register_refusals_name_the_field(pool: Pool) -> None:
    pool.add("d", "decode", layout="a")
    reg = control_pb2.Register(
        protocol_version=control_pb2.PROTOCOL_VERSION_1,
        role=serving_pb2.WORKER_ROLE_PREFILL,
        endpoint=control_pb2.WorkerEndpoint(worker_id="p"),
        model=pool.model.name,
        model_identity=pool.model.identity,
        context_length=pool.model.context_length,
        kv_layout=control_pb2.KvLayout(block_size=32, hash="b"),
        num_blocks=8,
    )
    assert "kv_layout.block_size" in (pool.registry.refusal("p", reg) or "")
    assert "socket identity" in (pool.registry.refusal("other", reg) or "")
    reg.model = "other"
    assert (pool.registry.refusal("p", reg) or "").startswith("model 'other'")
    reg.model, reg.context_length = pool.model.name, 16
    assert (pool.registry.refusal("p", reg) or "").startswith("context_length 16")


def test_a_decode_worker_is_priced_by_the_prefill_workers_reports(pool: Pool) -> None:
    """A decode worker's step report is over decodes: its average (45 ms over 6 tokens) and its slope
    (what one more running sequence adds, 10 ms) are no prompt cost, so the router costs its prompt
    tokens at the prefill workers' mean. A prefill worker is priced by its own report, a slope with
    its base clamped to 0 included (it once borrowed the decode worker's 10 ms instead); a colocated
    worker by its own fit."""
    pool.add("p1", "prefill")
    pool.add("p2", "prefill")
    pool.add("d", "decode")
    pool.add("c", "colocated")
    pool.report("p1", us_per_token=1000.0, step_base_ms=30.0)
    pool.report("p2", us_per_token=1400.0, step_base_ms=20.0)
    pool.report("d", us_per_token=7500.0)  # 45 ms over 6 decode tokens
    cost = pool.router.cost_us_per_token
    assert cost(pool.registry.get("d")) == pytest.approx(1200.0)  # type: ignore[arg-type]
    assert cost(pool.registry.get("p1")) == pytest.approx(1000.0)  # type: ignore[arg-type]
    pool.report("d", us_per_token=10_000.0, step_base_ms=40.0)
    pool.report("p2", us_per_token=1400.0)  # a slope whose base clamped to 0
    assert cost(pool.registry.get("d")) == pytest.approx(1200.0)  # type: ignore[arg-type]
    assert cost(pool.registry.get("p2")) == pytest.approx(1400.0)  # type: ignore[arg-type]
    pool.report("c", us_per_token=900.0, step_base_ms=25.0)
    assert cost(pool.registry.get("c")) == pytest.approx(900.0)  # type: ignore[arg-type]
    assert cost(pool.registry.get("d")) == pytest.approx((1000.0 + 1400.0 + 900.0) / 3)  # type: ignore[arg-type]
    for w in ("p1", "p2", "d", "c"):  # no reports at all: the default
        pool.report(w)
    assert cost(pool.registry.get("d")) == pytest.approx(DEFAULT_PREFILL_US_PER_TOKEN)  # type: ignore[arg-type]


# P at 1 ms a token and 20 ms a step, 512 tokens a step, one 1,024-token document queued
THRESHOLD_LOAD = {"us_per_token": 1000.0, "step_base_ms": 20.0, "step_token_budget": 512}


def test_a_short_prompt_is_priced_beside_a_long_one_under_the_threshold(pool: Pool) -> None:
    """Under --long-prefill-token-threshold 128 a 64-token chat waits out half the document's chunk
    in flight (20 + 128 ms, halved), then goes first in the next step, the document keeping one block
    (16 tokens) of it, not after the document's 1,024 tokens; a second document waits for the first
    at 128 tokens a step. With 400 short tokens queued ahead the chat rides their step, and a document
    behind them all takes that step's block, then 128 tokens a step. Without the threshold: first
    come, first served."""
    pool.add("p", "prefill")
    pool.add("d", "decode", num_blocks=1000)
    p = pool.registry.get("p")
    assert p is not None
    pool.report(
        "p", queued_tokens=1024, queued_long_tokens=1024, long_prefill_token_threshold=128, **THRESHOLD_LOAD
    )
    in_flight = (20 + 128) / 2
    assert pool.router.prefill_ms(p, 64) == pytest.approx(in_flight + 80 + 20)
    assert pool.router.prefill_ms(p, 1024) == pytest.approx(2048 + 16 * 20)  # 16 steps of 128
    placed = pool.router.place(list(range(1024)))
    assert placed is not None
    pool.router.commit(placed)  # placed since the report: a long prompt too
    assert p.pending_long_tokens == 1024 and pool.router.prefill_ms(p, 64) == pytest.approx(in_flight + 100)
    assert pool.router.prefill_ms(p, 1024) == pytest.approx(3072 + 24 * 20)
    pool.report(
        "p",
        queued_tokens=1024 + 400,
        queued_long_tokens=1024,
        long_prefill_token_threshold=128,
        **THRESHOLD_LOAD,
    )
    # 464 short tokens first, in one step of 512 with the document's 16-token floor
    assert p.pending_long_tokens == 0 and pool.router.prefill_ms(p, 64) == pytest.approx(in_flight + 500)
    # a document behind all of it: the short step, then the other 2,032 tokens at 128 a step
    assert pool.router.prefill_ms(p, 1024) == pytest.approx(2448 + 17 * 20)
    pool.report("p", queued_tokens=1024, **THRESHOLD_LOAD)  # no threshold: behind the document
    assert pool.router.prefill_ms(p, 64) == pytest.approx(1088 + 3 * 20)
