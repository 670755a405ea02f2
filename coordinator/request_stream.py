"""One admitted request's output stream, shared by both doors (gRPC servicer and OpenAI HTTP).

`stream_steps` drains the record's events, assembles them (`OutputAssembler`) and yields every step
that carries something to send: a delta, then at most one end (Finished or an error). The door turns a
step into its own wire format. If the consumer goes away first (client cancel or disconnect, a
deadline), the `finally` cancels the request the same way for both doors: its generation is bumped and
Abort goes to its workers. Consumers must close the generator when they stop early (`aclosing`), so
that the fan-out happens at once rather than when the generator is garbage-collected.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable

import structlog

from coordinator.dispatch import Dispatcher
from coordinator.metrics import CoordinatorMetrics
from coordinator.output import OutputAssembler, StreamStep
from coordinator.request_table import OutputEvent, RequestRecord
from splitserve.v1 import control_pb2, serving_pb2

log = structlog.get_logger(__name__)

AbortReason = control_pb2.AbortReason
# the client may give up on its own clock a little before the server's timer fires
DEADLINE_SLACK_S = 0.05


async def stream_steps(
    dispatcher: Dispatcher,
    metrics: CoordinatorMetrics,
    record: RequestRecord,
    time_remaining: Callable[[], float | None],
) -> AsyncGenerator[StreamStep, None]:
    """Steps of `record` until it ends; `time_remaining()` (None = no deadline) tells a deadline from a
    cancel when the consumer stops before the end."""
    bound = log.bind(rid=record.rid, request_id=record.admitted.request_id)
    bound.debug("admitted", prompt_tokens=len(record.admitted.prompt_token_ids))
    assembler = OutputAssembler(record, metrics)
    try:
        while True:
            step = assembler.push(await _next_events(record))
            if step.abort_engine:  # a stop string the worker could not see: stop its work now
                dispatcher.cancel(record, AbortReason.ABORT_REASON_STOP_STRING)
            if step.error is not None:
                metrics.requests.labels(step.error.code.name.lower()).inc()
                bound.info("request failed", code=step.error.code.name, message=step.error.message)
            if step.finished is not None:
                reason = serving_pb2.FinishReason.Name(step.finished.reason)
                metrics.requests.labels(reason.removeprefix("FINISH_REASON_").lower()).inc()
            if step.delta is not None or step.ended:
                yield step
            if step.ended:
                return
    finally:
        abandon(dispatcher, metrics, record, time_remaining)


def abandon(
    dispatcher: Dispatcher,
    metrics: CoordinatorMetrics,
    record: RequestRecord,
    time_remaining: Callable[[], float | None],
) -> None:
    """Cancel `record` if it has not ended: its consumer went away (client cancel or disconnect, or the
    deadline when `time_remaining()` is up). A no-op once the request ended; safe to call twice."""
    if record.ended:
        return
    remaining = time_remaining()
    deadline = remaining is not None and remaining <= DEADLINE_SLACK_S
    why = (
        AbortReason.ABORT_REASON_DEADLINE_EXCEEDED if deadline else AbortReason.ABORT_REASON_CLIENT_CANCELLED
    )
    metrics.requests.labels("deadline_exceeded" if deadline else "cancelled").inc()
    log.info(
        "request cancelled",
        rid=record.rid,
        request_id=record.admitted.request_id,
        reason=AbortReason.Name(why),
    )
    dispatcher.cancel(record, why)


async def _next_events(record: RequestRecord) -> list[OutputEvent]:
    """Wait for the record's next event, then take every event already queued (coalescing)."""
    events = [await record.events.get()]
    while not record.events.empty():
        events.append(record.events.get_nowait())
    return events
