"""The request table: rids and generations, duplicate request ids, and the output gate (each position
delivered once; late, stale and foreign outputs dropped and counted; gaps reported)."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from coordinator.auth import ANONYMOUS
from coordinator.errors import RpcError
from coordinator.metrics import CoordinatorMetrics
from coordinator.request_table import EndEvent, Outcome, RequestRecord, RequestTable, TokenEvent
from coordinator.served_model import ServedModel
from splitserve.v1 import control_pb2, serving_pb2
from splitserve.wire import pack_ids
from tests.coordinator.conftest import make_admitted

LENGTH, EOS = serving_pb2.FINISH_REASON_LENGTH, serving_pb2.FINISH_REASON_EOS_TOKEN


def tokens(
    record: RequestRecord,
    offset: int,
    ids: list[int],
    finish: serving_pb2.FinishReason.ValueType = serving_pb2.FINISH_REASON_UNSPECIFIED,
    generation: int | None = None,
) -> control_pb2.Tokens:
    gen = record.generation if generation is None else generation
    return control_pb2.Tokens(
        rid=record.rid, generation=gen, offset=offset, token_ids=pack_ids(ids), finish_reason=finish
    )


def events(record: RequestRecord) -> list[TokenEvent | EndEvent]:
    out = []
    while not record.events.empty():
        out.append(record.events.get_nowait())
    return out


@pytest.fixture
def table() -> RequestTable:
    return RequestTable(CoordinatorMetrics(), rid_start=100)


def placed(table: RequestTable, model: ServedModel, request_id: str = "r", **params: Any) -> RequestRecord:
    record = table.insert(make_admitted(model, request_id=request_id, **params))
    record.prefill_worker, record.decode_worker = "p", "d"
    return record


def test_rids_are_fresh_and_a_duplicate_request_id_in_flight_is_already_exists(
    table: RequestTable, served_model: ServedModel
) -> None:
    first = table.insert(make_admitted(served_model, request_id="same"))
    with pytest.raises(RpcError) as caught:
        table.insert(make_admitted(served_model, request_id="same"))
    assert (caught.value.code, caught.value.reason) == (
        grpc.StatusCode.ALREADY_EXISTS,
        "DUPLICATE_REQUEST_ID",
    )
    assert caught.value.metadata == {"request_id": "same"}
    other = table.insert(make_admitted(served_model, request_id="other"))
    assert (first.rid, other.rid) == (101, 102) and len(table) == 2
    table.end(first)
    again = table.insert(make_admitted(served_model, request_id="same"))  # no longer in flight
    assert again.rid == 103 and table.find(ANONYMOUS, "same") is again and table.get(first.rid) is None


def test_outputs_are_delivered_in_order_exactly_once(table: RequestTable, served_model: ServedModel) -> None:
    record = placed(table, served_model)
    assert table.accept("p", tokens(record, 0, [10]), from_prefill=True) is Outcome.ACCEPTED
    assert table.accept("d", tokens(record, 1, [11, 12]), from_prefill=False) is Outcome.ACCEPTED
    assert table.accept("d", tokens(record, 1, [11]), from_prefill=False) is Outcome.DROPPED  # duplicate
    assert table.accept("d", tokens(record, 2, [12, 13]), from_prefill=False) is Outcome.ACCEPTED  # overlap
    assert table.accept("d", tokens(record, 9, [19]), from_prefill=False) is Outcome.GAP
    assert record.output_token_ids == [10, 11, 12, 13]
    got = events(record)
    assert [(e.offset, e.token_ids) for e in got if isinstance(e, TokenEvent)] == [
        (0, [10]),
        (1, [11, 12]),
        (3, [13]),
    ]
    assert table.late_outputs_dropped == 0 and record.decode_started


def test_stale_unknown_and_foreign_outputs_are_dropped_and_counted(
    table: RequestTable, served_model: ServedModel
) -> None:
    record = placed(table, served_model)
    table.bump(record)
    assert table.accept("d", tokens(record, 0, [10], generation=0), from_prefill=False) is Outcome.DROPPED
    assert table.accept("x", tokens(record, 0, [10]), from_prefill=False) is Outcome.DROPPED  # not its worker
    assert table.accept("d", tokens(record, 0, [10]), from_prefill=True) is Outcome.DROPPED  # d is not its P
    unknown = control_pb2.Tokens(rid=999, generation=0, offset=0, token_ids=pack_ids([1]))
    assert table.accept("d", unknown, from_prefill=False) is Outcome.DROPPED
    assert table.late_outputs_dropped == 4 and events(record) == [] and record.output_token_ids == []


def test_the_end_removes_the_record_and_nothing_after_it_is_delivered(
    table: RequestTable, served_model: ServedModel
) -> None:
    record = placed(table, served_model)
    assert table.accept("d", tokens(record, 0, [10, 11], finish=EOS), from_prefill=False) is Outcome.FINISHED
    assert record.ended and table.get(record.rid) is None and table.find(ANONYMOUS, "r") is None
    assert table.accept("d", tokens(record, 2, [12]), from_prefill=False) is Outcome.DROPPED
    assert [e.finish_reason for e in events(record) if isinstance(e, TokenEvent)] == [EOS]
    assert table.late_outputs_dropped == 1


def test_tokens_past_max_tokens_never_reach_the_stream(
    table: RequestTable, served_model: ServedModel
) -> None:
    record = placed(table, served_model, max_tokens=3)
    table.accept("p", tokens(record, 0, [10]), from_prefill=True)
    assert table.accept("d", tokens(record, 1, [11, 12, 13, 14]), from_prefill=False) is Outcome.FINISHED
    last = events(record)[-1]
    assert isinstance(last, TokenEvent) and last.token_ids == [11, 12] and last.finish_reason == LENGTH


def test_logprobs_follow_their_tokens_through_a_partial_duplicate(
    table: RequestTable, served_model: ServedModel
) -> None:
    record = placed(table, served_model, logprobs=1)
    table.accept("p", tokens(record, 0, [10]), from_prefill=True)
    msg = tokens(record, 0, [10, 11])
    msg.logprobs.CopyFrom(
        control_pb2.TokenLogprobs(
            logprobs=[-0.5, -1.5], top_n=1, top_token_ids=pack_ids([10, 12]), top_logprobs=[-0.5, -0.25]
        )
    )
    assert table.accept("d", msg, from_prefill=False) is Outcome.ACCEPTED
    last = events(record)[-1]
    assert isinstance(last, TokenEvent) and last.token_ids == [11]
    assert [(lp.token_id, lp.logprob) for lp in last.logprobs] == [(11, -1.5)]
    assert [(t.token_id, t.logprob) for t in last.logprobs[0].top] == [(12, -0.25)]


async def test_wait_empty_returns_once_the_last_request_ended(
    table: RequestTable, served_model: ServedModel
) -> None:
    record = placed(table, served_model)
    assert len(table) == 1
    table.end(record, EndEvent(None))
    await table.wait_empty()
    assert events(record) == [EndEvent(None)]


def test_decode_output_that_overtakes_the_prefill_token_waits_for_it(
    table: RequestTable, served_model: ServedModel
) -> None:
    record = placed(table, served_model, max_tokens=4)
    assert table.accept("d", tokens(record, 1, [11]), from_prefill=False) is Outcome.HELD
    assert table.accept("d", tokens(record, 2, [12, 13], finish=EOS), from_prefill=False) is Outcome.HELD
    assert events(record) == [] and record.output_token_ids == []
    assert table.accept("p", tokens(record, 0, [10]), from_prefill=True) is Outcome.FINISHED
    got = [(e.offset, e.token_ids, e.finish_reason) for e in events(record) if isinstance(e, TokenEvent)]
    assert got == [(0, [10], 0), (1, [11], 0), (2, [12, 13], EOS)]
    other = placed(table, served_model, request_id="gap")
    table.accept("p", tokens(other, 0, [10]), from_prefill=True)
    assert table.accept("d", tokens(other, 2, [12]), from_prefill=False) is Outcome.GAP  # a real gap


@pytest.fixture
def holding() -> RequestTable:
    return RequestTable(CoordinatorMetrics(), rid_start=200, hold_first_token=True)


def offsets(record: RequestRecord) -> list[tuple[int, list[int]]]:
    return [(e.offset, e.token_ids) for e in events(record) if isinstance(e, TokenEvent)]


def test_a_shipped_first_token_streams_when_its_decode_worker_announces_it(
    holding: RequestTable, served_model: ServedModel
) -> None:
    record = placed(holding, served_model)
    assert holding.accept("p", tokens(record, 0, [10]), from_prefill=True) is Outcome.ACCEPTED
    assert events(record) == [] and record.output_token_ids == [10]  # accepted, not yet streamed
    assert not record.stats.kv_transfer_in_ttft
    # D's announce at its first step: a duplicate of token 1, which streams the parked one
    assert holding.accept("d", tokens(record, 0, [10]), from_prefill=False) is Outcome.DROPPED
    assert offsets(record) == [(0, [10])] and record.stats.kv_transfer_in_ttft
    assert holding.accept("d", tokens(record, 1, [11]), from_prefill=False) is Outcome.ACCEPTED
    assert offsets(record) == [(1, [11])]


def test_decode_output_before_the_announce_streams_the_first_token_ahead_of_it(
    holding: RequestTable, served_model: ServedModel
) -> None:
    record = placed(holding, served_model)
    holding.accept("p", tokens(record, 0, [10]), from_prefill=True)
    assert holding.accept("d", tokens(record, 1, [11, 12]), from_prefill=False) is Outcome.ACCEPTED
    assert offsets(record) == [(0, [10]), (1, [11, 12])]
    # and D's output that overtook P's token still comes after it
    early = placed(holding, served_model, request_id="early")
    assert holding.accept("d", tokens(early, 1, [11]), from_prefill=False) is Outcome.HELD
    assert holding.accept("p", tokens(early, 0, [10]), from_prefill=True) is Outcome.ACCEPTED
    assert offsets(early) == [(0, [10]), (1, [11])]


def test_a_parked_first_token_streams_before_the_next_run_and_never_after_a_cancel(
    holding: RequestTable, served_model: ServedModel
) -> None:
    record = placed(holding, served_model)
    holding.accept("p", tokens(record, 0, [10]), from_prefill=True)
    holding.bump(record)  # e.g. its decode worker died before joining: resumed after token 1
    assert events(record) == [] and record.parked is not None
    # the next run's prefill worker samples token 2: token 1 streams first, token 2 is held in turn
    assert holding.accept("p", tokens(record, 1, [11]), from_prefill=True) is Outcome.ACCEPTED
    assert offsets(record) == [(0, [10])] and not record.stats.kv_transfer_in_ttft
    assert holding.accept("d", tokens(record, 1, [11]), from_prefill=False) is Outcome.DROPPED  # announce
    assert offsets(record) == [(1, [11])] and record.stats.kv_transfer_in_ttft
    cancelled = placed(holding, served_model, request_id="cancelled")
    holding.accept("p", tokens(cancelled, 0, [10]), from_prefill=True)
    holding.bump(cancelled)  # the dispatcher's cancel: bump, then end with the call's status
    holding.end(cancelled, EndEvent(None))
    assert events(cancelled) == [EndEvent(None)] and cancelled.parked is None


def test_only_a_shipped_unfinished_first_token_is_parked(
    holding: RequestTable, table: RequestTable, served_model: ServedModel
) -> None:
    done = placed(holding, served_model, request_id="one")  # the prefill worker's token ends it
    assert holding.accept("p", tokens(done, 0, [10], finish=EOS), from_prefill=True) is Outcome.FINISHED
    assert offsets(done) == [(0, [10])]
    local = holding.insert(make_admitted(served_model, request_id="local"))
    local.prefill_worker = local.decode_worker = "d"  # colocated, or prefilled on its decode worker
    holding.accept("d", tokens(local, 0, [10]), from_prefill=True)
    assert offsets(local) == [(0, [10])]
    streamed = placed(table, served_model)  # --first-token-from prefill: at once, D's copy dropped
    table.accept("p", tokens(streamed, 0, [10]), from_prefill=True)
    assert offsets(streamed) == [(0, [10])]
    assert table.accept("d", tokens(streamed, 0, [10]), from_prefill=False) is Outcome.DROPPED
    assert events(streamed) == [] and not streamed.stats.kv_transfer_in_ttft
