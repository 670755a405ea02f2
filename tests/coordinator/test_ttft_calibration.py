"""The router's correction of long prompts' first-token estimates (coordinator/ttft_calibration.py):
learned per worker and path from the first tokens the request table streams, applied to long
prompts only, carried in Timings.routing and a metric."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from coordinator.dispatch import Dispatcher
from coordinator.metrics import CoordinatorMetrics
from coordinator.request_table import RequestState, RequestTable
from coordinator.router import LOCAL, REMOTE
from coordinator.routing_policy import RoutingPolicy
from coordinator.served_model import ServedModel
from coordinator.ttft_calibration import KEEP, MAX_RATIO, WINDOW_S, TtftProbe, long_ttft_factor
from splitserve.v1 import control_pb2
from splitserve.wire import pack_ids
from tests.coordinator.conftest import Pool, document_on_p_pool, make_admitted

DOCUMENT, CHAT = list(range(1000)), list(range(2000, 2064))


def fire(probe: TtftProbe, observed_ms: float) -> float:
    return probe.fire(probe.placed_at + observed_ms / 1e3)


def document_pool(served_model: ServedModel) -> Pool:
    """P prefilling a 1,000-token document (`document_on_p_pool`); D beside two decodes under
    threshold 128 (1 ms a prompt token, 64 a step, 15 ms a decode step): a second document is counted
    sooner on D than behind P's."""
    pool = document_on_p_pool(served_model)
    pool.report(
        "d", step_token_budget=512, running_requests=2, prefill_tokens_while_decoding=64,
        decode_step_ms=15.0, kv_transfer_ms=3.0, prompt_beside_decodes_us_per_token=1000.0,
        prompt_beside_decodes_base_ms=2.0, long_prefill_token_threshold=128,
    )  # fmt: skip
    return pool


def test_a_decode_worker_whose_documents_ran_late_sends_the_next_one_to_the_prefill_worker(
    served_model: ServedModel,
) -> None:
    pool = document_pool(served_model)
    first = pool.router.place(DOCUMENT)
    assert first is not None and first.path == LOCAL and first.local_ttft_factor == 1.0
    assert first.local_ttft_ms < first.remote_ttft_ms
    chat = pool.router.place(CHAT)
    assert chat is not None
    d = pool.registry.get("d")
    assert d is not None
    # D's documents took 2x their count (chats went first, their decodes lengthened its steps): one
    # such observation is not yet a pattern, two are
    assert fire(TtftProbe(d, LOCAL, first.local_ttft_ms), 2 * first.local_ttft_ms) == pytest.approx(2.0)
    assert pool.router.place(DOCUMENT) == first
    fire(TtftProbe(d, LOCAL, 1000.0), 2000.0)
    second = pool.router.place(DOCUMENT)
    assert second is not None and second.path == REMOTE and second.prefill.worker_id == "p"
    assert second.local_ttft_ms == pytest.approx(2 * first.local_ttft_ms)
    routing = second.routing()
    assert routing.local_ttft_factor == pytest.approx(2.0) and routing.remote_ttft_factor == 1.0
    # a chat's count (under D's threshold, before whatever arrives later) is left as it was
    again = pool.router.place(CHAT)
    assert again is not None and again.local_ttft_ms == pytest.approx(chat.local_ttft_ms)
    assert again.local_ttft_factor == 1.0


def test_the_prefill_workers_factor_prices_its_documents_too(served_model: ServedModel) -> None:
    pool = document_pool(served_model)
    d = pool.registry.get("d")
    p = pool.registry.get("p")
    assert d is not None and p is not None
    for _ in range(2):
        fire(TtftProbe(d, LOCAL, 100.0), 200.0)
        fire(TtftProbe(p, REMOTE, 100.0), 150.0)
    placement = pool.router.place(DOCUMENT)
    assert placement is not None and placement.remote_ttft_factor == pytest.approx(1.5)
    counted = pool.router.prefill_ms(p, len(DOCUMENT)) + 3.0 + 15.0 / 2  # + the hop and D's step in flight
    assert placement.remote_ttft_ms == pytest.approx(1.5 * counted)


def test_the_factor_is_the_median_of_recent_clamped_observations_padded_with_the_count(
    served_model: ServedModel,
) -> None:
    pool = Pool(served_model)
    worker = pool.add("d", "decode")
    assert long_ttft_factor(worker, LOCAL) == 1.0
    stall = TtftProbe(worker, LOCAL, 10.0)
    assert fire(stall, 10_000.0) == MAX_RATIO  # a cold start's first document, say: clamped
    assert long_ttft_factor(worker, LOCAL) == 1.0  # and alone it moves nothing: median(4, 1, 1)
    fire(TtftProbe(worker, LOCAL, 100.0), 200.0)
    assert long_ttft_factor(worker, LOCAL) == pytest.approx(2.0)  # median(4, 2, 1)
    assert long_ttft_factor(worker, REMOTE) == 1.0  # per path
    for _ in range(KEEP):
        fire(TtftProbe(worker, LOCAL, 100.0), 110.0)
    assert long_ttft_factor(worker, LOCAL) == pytest.approx(1.1)  # the last KEEP only
    last = worker.long_ttft_ratios[LOCAL][-1][0]
    assert long_ttft_factor(worker, LOCAL, now=last + WINDOW_S + 1) == 1.0  # and the recent ones only
    pool.registry.remove("d")
    fresh = pool.add("d", "decode")  # a new registration under the same id starts afresh
    assert fresh is not worker and long_ttft_factor(fresh, LOCAL) == 1.0


def test_a_long_prompts_first_token_fires_the_probe_its_placement_armed(served_model: ServedModel) -> None:
    pool = Pool(served_model)
    pool.pair()
    pool.report("p", us_per_token=50.0, step_base_ms=2.0, long_prefill_token_threshold=1)  # 2+ tokens: long
    metrics = CoordinatorMetrics()
    table = RequestTable(metrics, rid_start=0, hold_first_token=True)
    dispatcher = Dispatcher(table, pool.registry, pool.router, metrics, lambda *_: None, max_queue=4)
    record = dispatcher.submit(make_admitted(pool.model, prompt="hello world, a longer prompt"))
    probe = record.ttft_probe
    assert probe is not None and probe.path == REMOTE and probe.worker is pool.registry.get("p")
    assert probe.estimated_ms == pytest.approx(record.stats.routing.estimated_ttft_ms)
    record.ttft_probe = replace(probe, estimated_ms=100.0, placed_at=time.monotonic() - 0.3)

    def tokens(offset: int, ids: list[int]) -> control_pb2.Tokens:
        return control_pb2.Tokens(rid=record.rid, generation=0, offset=offset, token_ids=pack_ids(ids))

    table.accept("p", tokens(0, [10]), from_prefill=True)  # parked: not yet streamed
    assert record.ttft_probe is not None and not probe.worker.long_ttft_ratios
    table.accept("d", tokens(0, [10]), from_prefill=False)  # D's announce streams it
    assert record.ttft_probe is None
    [(_, ratio)] = probe.worker.long_ttft_ratios[REMOTE]
    assert 3.0 <= ratio <= MAX_RATIO
    assert (
        metrics.registry.get_sample_value(
            "splitserve_coordinator_long_prompt_ttft_ratio_count", {"decision": "remote"}
        )
        == 1.0
    )


def test_short_prompts_unfitted_workers_and_resumed_requests_arm_no_probe(served_model: ServedModel) -> None:
    pool = Pool(served_model)
    pool.pair()
    pool.report("p", us_per_token=50.0, long_prefill_token_threshold=256)
    metrics = CoordinatorMetrics()
    table = RequestTable(metrics, rid_start=0)
    dispatcher = Dispatcher(table, pool.registry, pool.router, metrics, lambda *_: None, max_queue=4)
    short = dispatcher.submit(make_admitted(pool.model, request_id="short"))
    assert short.stats.routing is not None and short.ttft_probe is None
    pool.report("p", us_per_token=50.0, long_prefill_token_threshold=1)  # long, but P has no fit of its own
    unfitted = dispatcher.submit(make_admitted(pool.model, request_id="unfitted"))
    assert unfitted.stats.routing is not None and unfitted.ttft_probe is None
    pool.report("p", us_per_token=50.0, step_base_ms=2.0, long_prefill_token_threshold=1)
    resumed = dispatcher.submit(make_admitted(pool.model, request_id="long"))
    assert resumed.ttft_probe is not None
    resumed.output_token_ids.extend([5, 6])  # streamed two tokens, then preempted
    dispatcher.resume(resumed, "preempted")  # its next first token is no first token: nothing to learn
    assert resumed.generation == 1 and resumed.state is RequestState.RUNNING and resumed.ttft_probe is None


def test_a_local_placement_is_probed_once_the_decode_worker_prices_prompts_by_its_own_fit(
    served_model: ServedModel,
) -> None:
    """D's step fit may have no slope (steps of one size: step base 0) while its fit of prompt
    tokens beside decodes, which prices the local path, is measured: that is an own fit."""
    pool = Pool(served_model, RoutingPolicy("never"))
    pool.pair()
    pool.report("d", step_token_budget=512, long_prefill_token_threshold=1, us_per_token=7500.0)
    metrics = CoordinatorMetrics()
    table = RequestTable(metrics, rid_start=0)
    dispatcher = Dispatcher(table, pool.registry, pool.router, metrics, lambda *_: None, max_queue=4)
    borrowed = dispatcher.submit(make_admitted(pool.model, request_id="borrowed"))
    assert borrowed.stats.routing is not None and borrowed.stats.routing.path == LOCAL
    assert borrowed.ttft_probe is None  # priced at its whole-step average: no fit of its own yet
    pool.report(
        "d", step_token_budget=512, long_prefill_token_threshold=1, us_per_token=7500.0,
        prompt_beside_decodes_us_per_token=1000.0,
    )  # fmt: skip
    own = dispatcher.submit(make_admitted(pool.model, request_id="own"))
    assert own.ttft_probe is not None and own.ttft_probe.path == LOCAL
