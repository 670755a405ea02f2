"""The request table: rid -> request record, with a version, and the gate every worker output passes.

A record is created when admission passes (`insert`) and leaves the table when the request ends
(finish, cancel, failure). While it is in the table, the dispatcher changes its placement and bumps its
`generation` (cancel, preemption, re-placement, resume); the control loop feeds worker outputs through
`accept`, which delivers each output position to the record's stream exactly once:

    dropped and counted   unknown rid, ended request, other generation, or not from the current owner
    dropped (duplicate)   every token at or below what the stream already has
    held                  decode output that arrived before the prefill worker's first token (two
                          senders, two sockets: no order between them); replayed when it arrives
    parked                the prefill worker's token of a shipped request, accepted but not yet
                          streamed (`hold_first_token`, --first-token-from decode): the decode
                          worker's first output for it (its announce at its first step) streams it,
                          and so does any later run's first output (a resumed request goes on after
                          it); a request that ends without a finish (cancel, deadline, failure) drops
                          it: nothing reaches a client after its request was cancelled
    GAP                   an offset past the next expected position: an error the caller recovers from
    accepted              new tokens go to the record's event queue, in order

The gRPC stream handler owns the consuming end of `events`; nothing else reads it. Client request ids
are scoped per principal (`find`, `insert`): a principal never learns of another's request.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import structlog

from coordinator.admission import AdmittedRequest
from coordinator.auth import Principal
from coordinator.errors import RpcError, clip
from coordinator.metrics import CoordinatorMetrics
from coordinator.router import decision_name
from coordinator.ttft_calibration import TtftProbe
from splitserve.v1 import control_pb2, serving_pb2
from splitserve.wire import ids_array, unpack_ids

log = structlog.get_logger(__name__)

# decode outputs kept while the prefill worker's first token is still on its way; more is a gap
MAX_HELD_OUTPUTS = 64


class RequestState(enum.Enum):
    QUEUED = "queued"  # in the admission queue; no worker holds anything for it
    AWAITING_DECODE = "awaiting_decode"  # prefilling on P; its decode worker refused, a new one is sought
    RUNNING = "running"  # placed on P and D, or on one colocated worker


class Outcome(enum.Enum):
    ACCEPTED = "accepted"
    FINISHED = "finished"  # accepted, and it ended the request (the record left the table)
    DROPPED = "dropped"
    HELD = "held"  # waits for the prefill worker's token
    GAP = "gap"


@dataclass(slots=True)
class TokenEvent:
    """New output tokens at `offset` (always the stream's next position); `finish_reason` 0 = more follow."""

    offset: int
    token_ids: list[int]
    logprobs: list[serving_pb2.TokenLogprob]
    finish_reason: int = 0


@dataclass(slots=True)
class EndEvent:
    """The request ended without a worker finish: `error` is the call's status; None = Abort RPC."""

    error: RpcError | None = None


OutputEvent = TokenEvent | EndEvent


@dataclass(slots=True)
class RequestStats:
    """Per-boundary numbers for Usage and Timings, summed over every run of the request."""

    queue_ms: float = 0.0  # admission queue + prefill worker queue
    prefill_ms: float = 0.0
    kv_transfer_ms: float = 0.0
    kv_transfer_in_ttft: bool = False  # a first token waited for its decode worker (parked)
    cached_prompt_tokens: int | None = None  # from the first prefill
    preemptions: int = 0
    routing: serving_pb2.RoutingDecision | None = None  # the last placement's (the dispatcher's)


@dataclass(slots=True, eq=False)
class RequestRecord:
    """One admitted request. Created by `RequestTable.insert`; placement fields are the dispatcher's."""

    rid: int
    admitted: AdmittedRequest
    generation: int = 0
    state: RequestState = RequestState.QUEUED
    prefill_worker: str | None = None  # the colocated worker's id too, when colocated
    decode_worker: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    # what the current generation's workers were sent: a re-placed decode worker must reserve for
    # exactly the sequence the prefill worker computes, not for tokens streamed since
    dispatched: control_pb2.ExecutionRequest | None = None
    events: asyncio.Queue[OutputEvent] = field(default_factory=asyncio.Queue)
    stats: RequestStats = field(default_factory=RequestStats)
    enqueued_at: float = field(default_factory=time.monotonic)
    prefill_done: bool = False  # the current generation's prefill worker has sent its token
    decode_started: bool = False  # the current generation's decode worker has sent tokens
    held: list[control_pb2.Tokens] = field(default_factory=list)  # see Outcome.HELD
    parked: TokenEvent | None = None  # see the module doc
    ended: bool = False
    ttft_probe: TtftProbe | None = None  # the dispatcher's, fired when the first token streams

    @property
    def owners(self) -> list[str]:
        """Workers that may hold state for the current generation (each once)."""
        return list(dict.fromkeys(w for w in (self.prefill_worker, self.decode_worker) if w))


class RequestTable:
    """Owned by the coordinator app; used from the event loop only (not thread-safe)."""

    def __init__(
        self, metrics: CoordinatorMetrics, rid_start: int | None = None, *, hold_first_token: bool = False
    ) -> None:
        self.hold_first_token = hold_first_token
        # rids start from the start time in microseconds, so a restarted coordinator never reuses one
        self._next_rid = rid_start if rid_start is not None else time.time_ns() // 1000
        self._by_rid: dict[int, RequestRecord] = {}
        # request ids are the client's and scoped per principal: (principal id, request_id)
        self._by_request_id: dict[tuple[str, str], RequestRecord] = {}
        self.metrics = metrics
        self.late_outputs_dropped = 0
        self._empty = asyncio.Event()
        self._empty.set()

    def __len__(self) -> int:
        return len(self._by_rid)

    def records(self) -> Iterator[RequestRecord]:
        return iter(list(self._by_rid.values()))

    def get(self, rid: int) -> RequestRecord | None:
        return self._by_rid.get(rid)

    def find(self, principal: Principal, request_id: str) -> RequestRecord | None:
        """`principal`'s in-flight request `request_id`; another principal's is None, as if absent."""
        return self._by_request_id.get((principal.id, request_id))

    def insert(self, admitted: AdmittedRequest) -> RequestRecord:
        """A new record with a fresh rid; ALREADY_EXISTS while the same principal has a request with
        its request_id in flight."""
        key = (admitted.principal.id, admitted.request_id)
        if key in self._by_request_id:
            raise RpcError(
                grpc.StatusCode.ALREADY_EXISTS,
                "DUPLICATE_REQUEST_ID",
                f"a request with request_id {clip(admitted.request_id)!r} is already in flight; "
                "use a new request_id or wait for it to finish",
                metadata={"request_id": admitted.request_id},
            )
        self._next_rid += 1
        record = RequestRecord(rid=self._next_rid, admitted=admitted)
        self._by_rid[record.rid] = record
        self._by_request_id[key] = record
        self.metrics.active_requests.set(len(self._by_rid))
        self._empty.clear()
        return record

    async def wait_empty(self) -> None:
        """Return once no request is in flight (the drain waits on this, bounded by its timeout)."""
        await self._empty.wait()

    def bump(self, record: RequestRecord) -> int:
        """A new version: everything older is stale from now on. Returns the new generation."""
        record.generation += 1
        record.prefill_done = record.decode_started = False
        record.held.clear()
        record.ttft_probe = None
        return record.generation

    def end(self, record: RequestRecord, event: EndEvent | None = None) -> None:
        """Remove the record (idempotent); `event` tells its stream how it ended."""
        if record.ended:
            return
        record.ended = True
        self._by_rid.pop(record.rid, None)
        key = (record.admitted.principal.id, record.admitted.request_id)
        if self._by_request_id.get(key) is record:
            del self._by_request_id[key]
        self.metrics.active_requests.set(len(self._by_rid))
        if not self._by_rid:
            self._empty.set()
        record.parked = None  # its decode worker never started on it: the request ends before it
        if event is not None:
            record.events.put_nowait(event)

    def _stream_parked(self, record: RequestRecord) -> None:
        if record.parked is not None:
            self._stream(record, record.parked)
            record.parked = None

    def _stream(self, record: RequestRecord, event: TokenEvent) -> None:
        """Hand `event` to the record's stream; the first token fires the placement's probe."""
        probe, record.ttft_probe = record.ttft_probe, None
        if probe is not None and event.offset == 0:
            ratio = probe.fire(time.monotonic())
            self.metrics.long_prompt_ttft_ratio.labels(decision_name(probe.path)).observe(ratio)
        record.events.put_nowait(event)

    def drop_late(self, why: str, rid: int) -> None:
        self.late_outputs_dropped += 1
        self.metrics.late_outputs_dropped.inc()
        log.debug("late output dropped", rid=rid, why=why)

    def accept(self, sender: str, tokens: control_pb2.Tokens, *, from_prefill: bool) -> Outcome:
        """Gate one worker output (PrefillDone.output when `from_prefill`, else a TokenBatch item)."""
        outcome = self._accept(sender, tokens, from_prefill)
        record = self._by_rid.get(tokens.rid)
        if from_prefill and outcome is Outcome.ACCEPTED and record is not None and record.held:
            held, record.held = record.held, []
            for item in held:  # the decode outputs that overtook this token, in arrival order
                outcome = self._accept(record.decode_worker or "", item, from_prefill=False)
                if outcome in (Outcome.GAP, Outcome.FINISHED):
                    break
            else:
                outcome = Outcome.ACCEPTED
        return outcome

    def _accept(self, sender: str, tokens: control_pb2.Tokens, from_prefill: bool) -> Outcome:
        record = self._by_rid.get(tokens.rid)
        if record is None:
            self.drop_late("unknown or ended rid", tokens.rid)
            return Outcome.DROPPED
        owner = record.prefill_worker if from_prefill else record.decode_worker
        if tokens.generation != record.generation or sender != owner:
            self.drop_late(f"generation {tokens.generation} from {sender}", tokens.rid)
            return Outcome.DROPPED
        have = len(record.output_token_ids)
        if record.parked is not None:  # the request runs on: the held token streams before this output
            record.stats.kv_transfer_in_ttft |= not from_prefill  # its decode worker released it
            self._stream_parked(record)
        if from_prefill:
            record.prefill_done = True
        elif not record.prefill_done and tokens.offset > have and len(record.held) < MAX_HELD_OUTPUTS:
            record.held.append(tokens)
            return Outcome.HELD
        if tokens.offset > have:
            log.error("output gap", rid=record.rid, expected_offset=have, got_offset=tokens.offset)
            return Outcome.GAP
        ids = unpack_ids(tokens.token_ids)
        skip = have - tokens.offset
        new = ids[skip:]
        finish = tokens.finish_reason
        room = record.admitted.params.max_tokens - have
        if len(new) >= room:  # nothing past max_tokens reaches the client, whatever the worker sent
            new, finish = new[:room], finish or serving_pb2.FINISH_REASON_LENGTH
        if not new and not finish:
            return Outcome.DROPPED  # a duplicate
        if not from_prefill:
            record.decode_started = True
        if tokens.HasField("kv_transfer_ms"):
            record.stats.kv_transfer_ms += tokens.kv_transfer_ms
        record.output_token_ids.extend(new)
        logprobs = convert_logprobs(tokens, skip, len(new)) if tokens.HasField("logprobs") else []
        event = TokenEvent(have, new, logprobs, finish)
        if (
            from_prefill
            and not finish
            and self.hold_first_token
            and record.decode_worker != record.prefill_worker
        ):
            record.parked = event  # shipped: it streams when its decode worker starts on it
            return Outcome.ACCEPTED
        self._stream(record, event)
        if finish:
            self.end(record)
            return Outcome.FINISHED
        return Outcome.ACCEPTED


def convert_logprobs(tokens: control_pb2.Tokens, skip: int, count: int) -> list[serving_pb2.TokenLogprob]:
    """The public per-token logprobs of tokens[skip : skip + count]."""
    lp = tokens.logprobs
    ids = ids_array(tokens.token_ids)
    top_ids = ids_array(lp.top_token_ids)
    n = lp.top_n
    out = []
    for i in range(skip, skip + count):
        top = [
            serving_pb2.TopLogprob(token_id=int(top_ids[j]), logprob=lp.top_logprobs[j])
            for j in range(i * n, (i + 1) * n)
        ]
        out.append(serving_pb2.TokenLogprob(token_id=int(ids[i]), logprob=lp.logprobs[i], top=top))
    return out
