"""The output path of one stream: accepted token events in, Delta and Finished messages out.

Incremental detokenization and stop strings are `engine.detokenizer.IncrementalDetokenizer`'s; this
module adds what a stream needs around it: offsets (each output position is sent once: the request
table already dropped duplicates and older generations), the finish reason and matched stop, usage, the
per-boundary timings, and the latency metrics. When a stop string appears in tokens the worker did not
mark as the end, the step says `abort_engine`: the caller must stop the engine work at once (the worker
has already computed past the stop and would keep going).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from coordinator.errors import RpcError
from coordinator.metrics import CoordinatorMetrics
from coordinator.request_table import EndEvent, OutputEvent, RequestRecord, TokenEvent
from engine.detokenizer import IncrementalDetokenizer
from splitserve.v1 import serving_pb2


@dataclass(slots=True)
class StreamStep:
    """What to send for one batch of events: a delta (or None), then Finished or an error status."""

    delta: serving_pb2.Delta | None = None
    finished: serving_pb2.Finished | None = None
    error: RpcError | None = None
    abort_engine: bool = False  # a stop string ended the output before the worker did

    @property
    def ended(self) -> bool:
        return self.finished is not None or self.error is not None


class OutputAssembler:
    """Created by the stream handler for its record; used by that handler only."""

    def __init__(self, record: RequestRecord, metrics: CoordinatorMetrics) -> None:
        admitted = record.admitted
        self.record = record
        self.metrics = metrics
        self.detok = IncrementalDetokenizer(
            admitted.model.tokenizer,
            admitted.prompt_token_ids,
            skip_special_tokens=admitted.skip_special_tokens,
            stop=admitted.params.stop,
            include_stop_str_in_output=admitted.include_stop_str_in_output,
        )
        self.next_offset = 0
        self._prompt_ids_pending = admitted.return_prompt_token_ids
        self._first_token_at: float | None = None
        self._last_token_at: float | None = None

    def push(self, events: Sequence[OutputEvent]) -> StreamStep:
        """Coalesce `events` (in order) into one step; events after the end are ignored."""
        step = StreamStep()
        text: list[str] = []
        ids: list[int] = []
        logprobs: list[serving_pb2.TokenLogprob] = []
        offset = self.next_offset
        end: _End | None = None
        for event in events:
            if isinstance(event, EndEvent):
                if event.error is not None:
                    step.error = event.error
                else:  # the Abort RPC: the output so far is valid, held-back text included
                    text.append(self.detok.finish())
                    end = _End(serving_pb2.FINISH_REASON_ABORTED)
                break
            assert isinstance(event, TokenEvent) and event.offset == self.next_offset, "output out of order"
            out = self.detok.push(event.token_ids)
            text.append(out.text)
            ids.extend(out.token_ids)
            logprobs.extend(event.logprobs[: len(out.token_ids)])
            self.next_offset += len(out.token_ids)
            if out.stopped:
                step.abort_engine = not event.finish_reason
                end = _End(serving_pb2.FINISH_REASON_STOP_STRING, stop_string=out.matched_stop)
                break
            if event.finish_reason:
                text.append(self.detok.finish())  # may still complete a stop string
                if self.detok.matched_stop is not None:
                    end = _End(serving_pb2.FINISH_REASON_STOP_STRING, stop_string=self.detok.matched_stop)
                elif event.finish_reason == serving_pb2.FINISH_REASON_STOP_TOKEN and ids:
                    end = _End(event.finish_reason, stop_token_id=ids[-1])
                else:
                    end = _End(event.finish_reason)
                break
        delta_text = "".join(text)
        ending = end is not None or step.error is not None
        if ids or delta_text or (self._prompt_ids_pending and ending):
            step.delta = serving_pb2.Delta(text=delta_text, token_ids=ids, logprobs=logprobs, offset=offset)
            if self._prompt_ids_pending:
                step.delta.prompt_token_ids.extend(self.record.admitted.prompt_token_ids)
                self._prompt_ids_pending = False
        now = time.monotonic()
        if ids:
            self._tokens_sent(now)
        if end is not None:
            step.finished = self._finished(end, now)
        return step

    def _tokens_sent(self, now: float) -> None:
        if self._first_token_at is None:
            self._first_token_at = now
            self.metrics.ttft.observe(now - self.record.admitted.arrival)
        elif self._last_token_at is not None:
            self.metrics.itl.observe(now - self._last_token_at)
        self._last_token_at = now

    def _finished(self, end: _End, now: float) -> serving_pb2.Finished:
        record, stats = self.record, self.record.stats
        arrival = record.admitted.arrival
        first, last = self._first_token_at, self._last_token_at
        if first is not None and last is not None and self.next_offset > 1:
            self.metrics.tpot.observe((last - first) / (self.next_offset - 1))
        prompt_tokens = len(record.admitted.prompt_token_ids)
        finished = serving_pb2.Finished(
            reason=end.reason,  # type: ignore[arg-type]
            usage=serving_pb2.Usage(
                prompt_tokens=prompt_tokens,
                completion_tokens=self.next_offset,
                cached_prompt_tokens=min(stats.cached_prompt_tokens or 0, prompt_tokens),
                preemptions=stats.preemptions,
            ),
            timings=serving_pb2.Timings(
                queue_ms=stats.queue_ms,
                prefill_ms=stats.prefill_ms,
                kv_transfer_ms=stats.kv_transfer_ms,
                first_token_ms=((first or now) - arrival) * 1e3,
                decode_ms=((last or now) - (first or now)) * 1e3,
                total_ms=(now - arrival) * 1e3,
                routing=stats.routing,
                kv_transfer_in_ttft=stats.kv_transfer_in_ttft,
            ),
        )
        if end.stop_string is not None:
            finished.stop_string = end.stop_string
        elif end.stop_token_id is not None:
            finished.stop_token_id = end.stop_token_id
        return finished


@dataclass(frozen=True, slots=True)
class _End:
    reason: int
    stop_string: str | None = None
    stop_token_id: int | None = None
