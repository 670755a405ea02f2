"""Output assembly: stop strings spanning tokens (and the engine abort they require), UTF-8 never split,
no token twice, nothing after the end, finish reasons, usage and timings."""

from __future__ import annotations

from typing import Any

from coordinator.errors import unavailable
from coordinator.metrics import CoordinatorMetrics
from coordinator.output import OutputAssembler
from coordinator.request_table import EndEvent, RequestRecord, TokenEvent
from coordinator.served_model import ServedModel
from splitserve.v1 import serving_pb2
from tests.coordinator.conftest import make_admitted

EOS, STOP_TOKEN, STOP_STRING = (
    serving_pb2.FINISH_REASON_EOS_TOKEN,
    serving_pb2.FINISH_REASON_STOP_TOKEN,
    serving_pb2.FINISH_REASON_STOP_STRING,
)
SENTENCE = " the device is blinking amber because"


def assembler(model: ServedModel, **params: Any) -> OutputAssembler:
    return OutputAssembler(
        RequestRecord(rid=1, admitted=make_admitted(model, **params)), CoordinatorMetrics()
    )


def encode(model: ServedModel, text: str) -> list[int]:
    return list(model.tokenizer.encode(text, add_special_tokens=False))


def test_a_stop_string_spanning_tokens_cuts_the_text_and_asks_to_abort_the_engine(
    served_model: ServedModel,
) -> None:
    ids = encode(served_model, SENTENCE)
    pieces = [served_model.tokenizer.decode([i]) for i in ids]
    k = pieces.index(" amber")  # the stop string starts in token k and ends in token k + 1
    stop = pieces[k][-3:] + pieces[k + 1][:2]
    out = assembler(served_model, stop=[stop], max_tokens=len(ids))
    first = out.push([TokenEvent(0, ids[: k + 1], [])])
    assert first.finished is None and not first.abort_engine
    assert SENTENCE.startswith(first.delta.text) and not first.delta.text.endswith(pieces[k][-3:])  # type: ignore[union-attr]
    rest = out.push([TokenEvent(k + 1, ids[k + 1 :], [])])
    assert rest.abort_engine and rest.finished is not None
    assert rest.finished.reason == STOP_STRING and rest.finished.stop_string == stop
    assert rest.delta is not None and rest.delta.offset == k + 1
    assert list(rest.delta.token_ids) == [ids[k + 1]]  # ids after the completing token are dropped
    text = first.delta.text + rest.delta.text  # type: ignore[union-attr]
    assert text == SENTENCE[: SENTENCE.index(stop)]
    assert rest.finished.usage.completion_tokens == k + 2


def test_multi_byte_characters_are_never_split(served_model: ServedModel) -> None:
    ids = encode(served_model, "é€😀")
    out = assembler(served_model)
    texts = [out.push([TokenEvent(i, [t], [])]).delta.text for i, t in enumerate(ids[:-1])]  # type: ignore[union-attr]
    last = out.push([TokenEvent(len(ids) - 1, ids[-1:], [], finish_reason=EOS)])
    texts.append(last.delta.text)  # type: ignore[union-attr]
    assert "".join(texts) == "é€😀" and "\ufffd" not in "".join(texts)
    assert all(t in ("", "é", "€", "😀") for t in texts)


def test_coalesced_events_become_one_delta_and_each_token_is_sent_once(served_model: ServedModel) -> None:
    ids = encode(served_model, SENTENCE)
    out = assembler(served_model, max_tokens=len(ids))
    step = out.push([TokenEvent(0, ids[:2], []), TokenEvent(2, ids[2:4], [])])
    assert step.delta is not None and list(step.delta.token_ids) == ids[:4] and step.delta.offset == 0
    end = out.push([TokenEvent(4, ids[4:], [], finish_reason=serving_pb2.FINISH_REASON_LENGTH)])
    assert end.delta is not None and end.delta.offset == 4 and list(end.delta.token_ids) == ids[4:]
    assert step.delta.text + end.delta.text == SENTENCE
    assert end.finished is not None and end.finished.reason == serving_pb2.FINISH_REASON_LENGTH


def test_stop_token_and_eos_finish_with_the_flushed_text(served_model: ServedModel) -> None:
    ids = encode(served_model, " the device")
    out = assembler(served_model, stop_token_ids=[ids[-1]])
    step = out.push([TokenEvent(0, ids, [], finish_reason=STOP_TOKEN)])
    assert step.finished is not None and step.finished.reason == STOP_TOKEN
    assert step.finished.stop_token_id == ids[-1] and not step.abort_engine
    eos = assembler(served_model).push([TokenEvent(0, [*ids, 1], [], finish_reason=EOS)])
    assert eos.delta is not None and eos.delta.text == " the device"  # EOS is in the ids, not the text
    assert list(eos.delta.token_ids) == [*ids, 1] and eos.finished.reason == EOS  # type: ignore[union-attr]


def test_abort_rpc_and_failures_end_the_stream(served_model: ServedModel) -> None:
    admitted = make_admitted(served_model)
    admitted.return_prompt_token_ids = True
    out = OutputAssembler(RequestRecord(rid=1, admitted=admitted), CoordinatorMetrics())
    out.record.stats.preemptions = 1
    out.record.stats.prefill_ms = 3.0
    step = out.push([TokenEvent(0, [264], []), EndEvent(None)])
    assert step.finished is not None and step.finished.reason == serving_pb2.FINISH_REASON_ABORTED
    assert (
        step.delta is not None and list(step.delta.prompt_token_ids) == out.record.admitted.prompt_token_ids
    )
    usage, timings = step.finished.usage, step.finished.timings
    assert (usage.completion_tokens, usage.preemptions, timings.prefill_ms) == (1, 1, 3.0)
    assert timings.total_ms >= timings.first_token_ms >= 0
    failed = assembler(served_model).push([EndEvent(unavailable("WORKER_LOST", "gone"))])
    assert failed.error is not None and failed.error.reason == "WORKER_LOST" and failed.delta is None
