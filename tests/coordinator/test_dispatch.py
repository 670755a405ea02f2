"""The dispatcher: queue order, the last admission gates, and every change of placement (lost worker,
worker aborts, resume limit, cancellation), checked through the control messages it posts."""

from __future__ import annotations

import grpc
import pytest

from coordinator.auth import ANONYMOUS
from coordinator.dispatch import Dispatcher
from coordinator.errors import RpcError
from coordinator.metrics import CoordinatorMetrics
from coordinator.request_table import EndEvent, RequestState, RequestTable
from coordinator.served_model import ServedModel
from splitserve.v1 import control_pb2
from splitserve.wire import unpack_ids
from tests.coordinator.conftest import Pool, make_admitted

Sent = list[tuple[str, control_pb2.Envelope]]


@pytest.fixture
def sent() -> Sent:
    return []


@pytest.fixture
def dispatcher(pool: Pool, sent: Sent) -> Dispatcher:
    metrics = CoordinatorMetrics()
    table = RequestTable(metrics, rid_start=0)
    return Dispatcher(
        table,
        pool.registry,
        pool.router,
        metrics,
        lambda to, env: sent.append((to, env)),
        max_queue=2,
        max_resumes=2,
    )


def kinds(sent: Sent) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = [(to, env.WhichOneof("msg") or "") for to, env in sent]
    sent.clear()
    return out


def test_submit_dispatches_prefill_and_decode_at_once(pool: Pool, dispatcher: Dispatcher, sent: Sent) -> None:
    pool.pair()
    record = dispatcher.submit(make_admitted(pool.model))
    assert record.state is RequestState.RUNNING and (record.prefill_worker, record.decode_worker) == (
        "p",
        "d",
    )
    prefill, decode = sent[0][1].prefill, sent[1][1].decode
    assert kinds(sent) == [("p", "prefill"), ("d", "decode")]
    assert (
        prefill.request == decode.request
        and prefill.decode.worker_id == "d"
        and decode.prefill.worker_id == "p"
    )


def test_submit_without_workers_or_while_draining_is_unavailable(pool: Pool, dispatcher: Dispatcher) -> None:
    with pytest.raises(RpcError) as caught:
        dispatcher.submit(make_admitted(pool.model))
    assert (caught.value.code, caught.value.reason) == (grpc.StatusCode.UNAVAILABLE, "MODEL_NOT_READY")
    assert caught.value.retry_after_s is not None and len(dispatcher.table) == 0
    pool.add("c", "colocated")
    dispatcher.draining = True
    with pytest.raises(RpcError) as caught:
        dispatcher.submit(make_admitted(pool.model))
    assert caught.value.reason == "SHUTTING_DOWN"


def test_queue_is_bounded_and_ordered_by_priority_then_arrival(
    pool: Pool, dispatcher: Dispatcher, sent: Sent
) -> None:
    pool.pair(decode_free=0)
    late_low = dispatcher.submit(make_admitted(pool.model, request_id="a", priority=5))
    early_high = dispatcher.submit(make_admitted(pool.model, request_id="b", priority=0))
    with pytest.raises(RpcError) as caught:
        dispatcher.submit(make_admitted(pool.model, request_id="c"))
    assert (caught.value.code, caught.value.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "QUEUE_FULL")
    assert (
        caught.value.metadata == {"queue_depth": "2", "max_queue": "2"}
        and dispatcher.table.find(ANONYMOUS, "c") is None
    )
    assert sent == [] and len(dispatcher.queue) == 2
    pool.report("d", free=1)  # room for exactly one small request
    dispatcher.pump()
    assert early_high.state is RequestState.RUNNING and late_low.state is RequestState.QUEUED
    assert early_high.stats.queue_ms > 0


def test_a_lost_decode_worker_resumes_its_requests_elsewhere(
    pool: Pool, dispatcher: Dispatcher, sent: Sent
) -> None:
    pool.add("p", "prefill")
    pool.add("d1", "decode", num_blocks=64)
    pool.add("d2", "decode", num_blocks=32)
    record = dispatcher.submit(make_admitted(pool.model))
    assert record.decode_worker == "d1"
    record.output_token_ids.extend([5, 6])
    sent.clear()
    pool.registry.remove("d1")
    dispatcher.worker_lost("d1", "deregistered")
    abort = sent[0][1].abort
    assert (abort.rid, abort.generation, abort.reason) == (record.rid, 0, control_pb2.ABORT_REASON_REPLACED)
    resumed = sent[1][1].prefill.request
    assert kinds(sent) == [("p", "abort"), ("p", "prefill"), ("d2", "decode")]
    assert resumed.generation == 1 and unpack_ids(resumed.output_token_ids) == [5, 6]
    assert record.stats.preemptions == 1 and record.decode_worker == "d2"


def test_worker_aborts_fail_or_resume_and_resumes_are_bounded(
    pool: Pool, dispatcher: Dispatcher, sent: Sent
) -> None:
    pool.pair()
    record = dispatcher.submit(make_admitted(pool.model, request_id="lease"))
    for generation in (0, 1):
        lease = control_pb2.Abort(
            rid=record.rid, generation=generation, reason=control_pb2.ABORT_REASON_LEASE_EXPIRED
        )
        dispatcher.on_worker_abort("p", lease)
        assert record.generation == generation + 1 and not record.ended
    stale = control_pb2.Abort(rid=record.rid, generation=0, reason=control_pb2.ABORT_REASON_LEASE_EXPIRED)
    dispatcher.on_worker_abort("p", stale)  # an older generation: dropped, counted
    assert record.generation == 2 and dispatcher.table.late_outputs_dropped == 1
    third = control_pb2.Abort(rid=record.rid, generation=2, reason=control_pb2.ABORT_REASON_PEER_FAILED)
    dispatcher.on_worker_abort("d", third)
    end = record.events.get_nowait()
    assert isinstance(end, EndEvent) and end.error is not None and end.error.reason == "WORKER_LOST"
    assert record.ended and dispatcher.table.get(record.rid) is None

    failing = dispatcher.submit(make_admitted(pool.model, request_id="broken"))
    error = control_pb2.Abort(
        rid=failing.rid, generation=0, reason=control_pb2.ABORT_REASON_WORKER_ERROR, message="oom"
    )
    sent.clear()
    dispatcher.on_worker_abort("d", error)
    end = failing.events.get_nowait()
    assert isinstance(end, EndEvent) and end.error is not None and end.error.code == grpc.StatusCode.INTERNAL
    assert "oom" in end.error.message
    assert kinds(sent) == [("p", "abort"), ("d", "abort")]  # the other owner is told too


def test_cancel_bumps_once_and_aborts_each_owner_once(pool: Pool, dispatcher: Dispatcher, sent: Sent) -> None:
    pool.add("c", "colocated")
    record = dispatcher.submit(make_admitted(pool.model))
    assert kinds(sent) == [("c", "decode")] and not sent
    dispatcher.cancel(record, control_pb2.ABORT_REASON_CLIENT_CANCELLED)
    dispatcher.cancel(record, control_pb2.ABORT_REASON_CLIENT_CANCELLED)
    assert [(to, env.abort.generation) for to, env in sent] == [("c", 1)]
    assert record.ended and len(dispatcher.table) == 0


def test_queued_requests_fail_when_the_pool_vanishes(
    pool: Pool, dispatcher: Dispatcher, served_model: ServedModel
) -> None:
    pool.pair(decode_free=0)
    record = dispatcher.submit(make_admitted(served_model))
    assert record.state is RequestState.QUEUED
    pool.registry.remove("d")
    dispatcher.pump()
    end = record.events.get_nowait()
    assert isinstance(end, EndEvent) and end.error is not None and end.error.reason == "MODEL_NOT_READY"
    assert len(dispatcher.queue) == 0 and record.ended


def test_a_queued_request_that_no_longer_fits_any_pool_fails_with_the_limit(
    pool: Pool, dispatcher: Dispatcher
) -> None:
    pool.add("p", "prefill")
    pool.add("big", "decode", num_blocks=64)
    pool.add("small", "decode", num_blocks=1)
    pool.report("big", free=0)
    waiting = dispatcher.submit(make_admitted(pool.model, "word " * 30, request_id="w"))
    assert waiting.state is RequestState.QUEUED
    pool.registry.remove("big")
    dispatcher.pump()
    assert waiting.ended
    event = waiting.events.get_nowait()
    assert event.error is not None and event.error.reason == "PROMPT_TOO_LONG"  # type: ignore[union-attr]
