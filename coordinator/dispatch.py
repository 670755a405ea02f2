"""The dispatcher: admission queue -> placement -> Prefill/Decode, and every later change of placement.

It is the only code that moves a request between workers or ends it early, and it does both by the same
rule: bump the record's generation first, then tell the old owners (Abort), then place the new
generation. Outputs of older generations are dropped by the request table from then on.

    submit       never-fitting prompt (PROMPT_TOO_LONG) -> table.insert (ALREADY_EXISTS) -> queue
                 (QUEUE_FULL) -> pump
    dispatch     Prefill to P and Decode to D at once; or Decode alone (no prefill peer) when one
                 worker does both: a colocated worker, or a decode worker prefilling locally
                 (conditional disaggregation); the decision goes in Timings.routing and the
                 `decision` label of splitserve_coordinator_placements
    pump         parked requests first (their prefill is running), then the queue in order; a request
                 that cannot be placed now does not hold the ones behind it (backfill), and one that
                 no registered decode pool could ever hold fails with the limit
    ReserveFailed   park the request (P keeps its result under a lease) until a decode worker has room,
                    then Decode to the new D and Reassign to P; generation unchanged
    resume       preemption, lost worker, lease or transfer failure, output gap: new generation back
                 through prefill with output_token_ids = every token streamed so far
    cancel       client cancel, deadline, stop string, Abort RPC: new generation, Abort to P and D

All methods are synchronous and run on the event loop; messages leave through `post` (the outbox),
which never blocks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeAlias

import grpc
import structlog

from coordinator.admission import AdmittedRequest
from coordinator.admission_queue import AdmissionQueue
from coordinator.errors import RpcError, invalid, unavailable
from coordinator.metrics import CoordinatorMetrics
from coordinator.request_table import EndEvent, RequestRecord, RequestState, RequestTable
from coordinator.router import LOCAL, REMOTE, Placement, Router, RunningDecode
from coordinator.ttft_calibration import TtftProbe
from coordinator.workers import WorkerRegistry
from engine.config import long_prompt
from splitserve import wire
from splitserve.control import envelope
from splitserve.v1 import control_pb2

log = structlog.get_logger(__name__)

Post = Callable[[str, control_pb2.Envelope], None]
# queued requests one pump tries past the first that cannot be placed now (bounds the pump's work)
BACKFILL_SCAN = 32
AbortReason = control_pb2.AbortReason
Reason: TypeAlias = control_pb2.AbortReason.ValueType


class Dispatcher:
    """Owned by the coordinator app; shares the table, registry and router with the control loop."""

    def __init__(
        self,
        table: RequestTable,
        registry: WorkerRegistry,
        router: Router,
        metrics: CoordinatorMetrics,
        post: Post,
        *,
        max_queue: int,
        max_resumes: int = 4,
        retry_after_s: float = 1.0,
    ) -> None:
        self.table = table
        self.registry = registry
        self.router = router
        self.metrics = metrics
        self.post = post
        self.queue = AdmissionQueue(max_queue, retry_after_s)
        self.parked: dict[int, RequestRecord] = {}  # AWAITING_DECODE, by rid
        self.max_resumes = max_resumes
        self.retry_after_s = retry_after_s
        self.draining = False

    # -- entry ---------------------------------------------------------------------------------------
    def submit(self, admitted: AdmittedRequest) -> RequestRecord:
        """The last two admission gates; on success the request is queued (and placed if it fits now)."""
        if self.draining:
            raise unavailable("SHUTTING_DOWN", "the server is shutting down; send the request elsewhere")
        if not self.registry.can_serve():
            raise unavailable(
                "MODEL_NOT_READY",
                f"model {admitted.model.name!r} has no ready prefill and decode worker yet; retry shortly",
                retry_after_s=self.retry_after_s,
            )
        refusal = self._never_fits(len(admitted.prompt_token_ids))
        if refusal is not None:  # before any record or reservation exists
            raise refusal
        record = self.table.insert(admitted)
        try:
            self.queue.push(record)
        except RpcError:
            self.table.end(record)
            raise
        record.enqueued_at = time.monotonic()
        self.pump()
        return record

    def pump(self) -> None:
        """Place whatever fits now: parked requests first, then the queue head while placements succeed."""
        for waiting in list(self.parked.values()):
            prefill = self.registry.get(waiting.prefill_worker or "")
            if prefill is None:
                continue
            decode = self.router.choose_decode(self._num_tokens(waiting), prefill.layout_hash)
            if decode is not None:
                del self.parked[waiting.rid]
                self._reassign(waiting, decode.worker_id)
        blocked = 0
        for record in self.queue.ordered():
            if blocked > BACKFILL_SCAN:
                break
            sequence = record.admitted.prompt_token_ids + record.output_token_ids
            placement = self.router.place(sequence, self._running_decodes)
            if placement is not None:
                self.queue.remove(record)
                self._dispatch(record, placement)
            elif (refusal := self._never_fits(len(sequence))) is not None:  # the pool shrank
                self.cancel(record, AbortReason.ABORT_REASON_WORKER_ERROR, EndEvent(refusal))
            else:
                blocked += 1
        if (len(self.queue) or self.parked) and not self.registry.can_serve():
            for record in self.queue.drain_all() + list(self.parked.values()):
                self._fail_unplaceable(record)
        self.metrics.queue_depth.set(len(self.queue))

    # -- placement -----------------------------------------------------------------------------------
    def _never_fits(self, num_tokens: int) -> RpcError | None:
        """INVALID_ARGUMENT PROMPT_TOO_LONG naming the limit when no registered decode pool could
        ever hold `num_tokens` (waiting would block until the deadline, or forever)."""
        found = self.router.largest_pool_refusal(num_tokens)
        if found is None:
            return None
        needed, pool = found
        blocks, size = pool.register.num_blocks, pool.block_size
        return invalid(
            "prompt",
            f"the prompt needs {needed} KV blocks of {size} tokens ({num_tokens} tokens), but the largest "
            f"decode worker holds {blocks} blocks ({blocks * size} tokens) in all; shorten the prompt",
            reason="PROMPT_TOO_LONG",
            prompt_tokens=num_tokens,
            needed_blocks=needed,
            largest_pool_blocks=blocks,
            block_size=size,
        )

    def _running_decodes(self, decode_id: str) -> list[RunningDecode]:
        """The requests placed to decode on `decode_id` (output tokens left, max_tokens), for the
        router's TPOT projection."""
        out = []
        for record in self.table.records():
            if record.decode_worker == decode_id and record.state is RequestState.RUNNING:
                total = record.admitted.params.max_tokens
                out.append(RunningDecode(max(0, total - len(record.output_token_ids)), total))
        return out

    def _num_tokens(self, record: RequestRecord) -> int:
        """Tokens of the sequence a decode worker must hold: as dispatched to the current
        generation's prefill worker (tokens streamed since are not in its KV), else as it stands."""
        sent = record.dispatched
        if sent is not None and sent.generation == record.generation:
            return wire.ids_array(sent.prompt_token_ids).size + wire.ids_array(sent.output_token_ids).size
        return len(record.admitted.prompt_token_ids) + len(record.output_token_ids)

    def _dispatch(self, record: RequestRecord, placement: Placement) -> None:
        record.stats.queue_ms += (time.monotonic() - record.enqueued_at) * 1e3
        record.state = RequestState.RUNNING
        record.prefill_worker = placement.prefill.worker_id
        record.decode_worker = placement.decode.worker_id
        self.router.commit(placement)
        record.stats.routing = placement.routing()
        record.ttft_probe = self._probe(record, placement)
        self.metrics.placements.labels(placement.decision).inc()
        request = record.admitted.execution_request(record.rid, record.generation, record.output_token_ids)
        record.dispatched = request
        log.debug(
            "placed",
            rid=record.rid,
            generation=record.generation,
            decision=placement.decision,
            prefill=record.prefill_worker,
            decode=record.decode_worker,
            cached_tokens=placement.cached_tokens,
            estimated_ttft_ms=round(placement.estimated_ttft_ms, 2),
            remote_ttft_ms=round(placement.remote_ttft_ms, 2),
            local_ttft_ms=round(placement.local_ttft_ms, 2),
        )
        decode_endpoint = placement.decode.register.endpoint
        if placement.colocated:  # colocated, or conditional disaggregation's local prefill on D
            self.post(record.decode_worker, envelope(decode=control_pb2.Decode(request=request)))
            return
        prefill_endpoint = placement.prefill.register.endpoint
        # both at once: P starts computing while D reserves blocks and sends their ids straight to P
        self.post(
            record.prefill_worker,
            envelope(prefill=control_pb2.Prefill(request=request, decode=decode_endpoint)),
        )
        self.post(
            record.decode_worker,
            envelope(decode=control_pb2.Decode(request=request, prefill=prefill_endpoint)),
        )

    def _probe(self, record: RequestRecord, placement: Placement) -> TtftProbe | None:
        """A probe of the estimate for a long prompt's first token (coordinator/ttft_calibration.py),
        on the remote and local paths of a request that has streamed nothing yet, from a worker that
        prices it by its own fit (a borrowed or default cost's miss is not what the factor is for)."""
        worker, path = placement.prefill, placement.path
        if (
            record.output_token_ids
            or path not in (REMOTE, LOCAL)
            or not self.router.priced_by_own_fit(worker, path)
        ):
            return None
        if not long_prompt(worker.load.long_prefill_token_threshold, placement.uncached_tokens):
            return None
        return TtftProbe(worker, path, placement.estimated_ttft_ms / placement.ttft_factor)

    def _reassign(self, record: RequestRecord, decode_id: str) -> None:
        decode = self.registry.get(decode_id)
        prefill = self.registry.get(record.prefill_worker or "")
        assert decode is not None and prefill is not None
        record.state = RequestState.RUNNING
        record.decode_worker = decode_id
        record.ttft_probe = None  # its first token now waits for a second decode worker
        request = record.dispatched
        assert request is not None and request.generation == record.generation
        self.router.commit_decode(decode, self._num_tokens(record))
        log.info("re-placed decode", rid=record.rid, generation=record.generation, decode=decode_id)
        self.post(
            decode_id, envelope(decode=control_pb2.Decode(request=request, prefill=prefill.register.endpoint))
        )
        reassign = control_pb2.Reassign(
            rid=record.rid, generation=record.generation, decode=decode.register.endpoint
        )
        self.post(prefill.worker_id, envelope(reassign=reassign))

    def _fail_unplaceable(self, record: RequestRecord) -> None:
        if record.output_token_ids or record.stats.preemptions:
            error = unavailable(
                "WORKER_LOST", "the workers holding the request are gone and none can resume it"
            )
        else:
            error = unavailable(
                "MODEL_NOT_READY",
                "no ready prefill and decode worker is left for the model; retry shortly",
                retry_after_s=self.retry_after_s,
            )
        self.cancel(record, AbortReason.ABORT_REASON_WORKER_ERROR, EndEvent(error))

    # -- worker reports ------------------------------------------------------------------------------
    def _current(self, sender: str, rid: int, generation: int) -> RequestRecord | None:
        """The record when (rid, generation) is current and `sender` holds it; else count a late output."""
        record = self.table.get(rid)
        if record is None or generation != record.generation or sender not in record.owners:
            self.table.drop_late(f"generation {generation} from {sender}", rid)
            return None
        return record

    def on_reserve_failed(self, sender: str, msg: control_pb2.ReserveFailed) -> None:
        record = self._current(sender, msg.rid, msg.generation)
        if record is None or sender != record.decode_worker:
            return
        decode = self.registry.get(sender)
        if decode is not None:  # trust its word over the last report until the next one
            decode.pending_blocks = max(
                decode.pending_blocks, decode.free_blocks_estimate - msg.available_blocks
            )
        log.info(
            "reserve failed",
            rid=record.rid,
            decode=sender,
            needed=msg.needed_blocks,
            available=msg.available_blocks,
        )
        if record.prefill_worker == sender:  # colocated: nothing started, place it again as it is
            record.state, record.prefill_worker, record.decode_worker = RequestState.QUEUED, None, None
            record.enqueued_at = time.monotonic()
            self.queue.push(record, resumed=True)
        else:
            record.state, record.decode_worker = RequestState.AWAITING_DECODE, None
            self.parked[record.rid] = record
        self.pump()

    def on_preempted(self, sender: str, msg: control_pb2.Preempted) -> None:
        record = self._current(sender, msg.rid, msg.generation)
        if record is not None and sender == record.decode_worker:
            if msg.num_output_tokens != len(record.output_token_ids):
                log.warning(
                    "preempted with a token count mismatch",
                    rid=record.rid,
                    worker=msg.num_output_tokens,
                    streamed=len(record.output_token_ids),
                )
            self.resume(record, "preempted")

    def on_worker_abort(self, sender: str, msg: control_pb2.Abort) -> None:
        record = self._current(sender, msg.rid, msg.generation)
        if record is None:
            return
        log.info(
            "worker aborted",
            rid=record.rid,
            worker=sender,
            reason=AbortReason.Name(msg.reason),
            message=msg.message,
        )
        if msg.reason == AbortReason.ABORT_REASON_DEADLINE_EXCEEDED:
            error = RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, None, "the request's deadline passed")
            self.cancel(record, msg.reason, EndEvent(error))
        elif msg.reason == AbortReason.ABORT_REASON_WORKER_ERROR:
            error = RpcError(
                grpc.StatusCode.INTERNAL,
                "INTERNAL",
                f"worker {sender} could not run the request: {msg.message}",
            )
            self.cancel(record, msg.reason, EndEvent(error))
        else:  # lease ran out, transfer peer failed, worker shutting down: the request can run elsewhere
            self.resume(record, AbortReason.Name(msg.reason).removeprefix("ABORT_REASON_").lower())

    def worker_lost(self, worker_id: str, why: str) -> None:
        """Recover every request the worker holds: its decodes, and its prefills not yet decoding."""
        for record in self.table.records():
            holds_decode = record.decode_worker == worker_id
            holds_prefill = record.prefill_worker == worker_id and not record.decode_started
            if holds_decode or holds_prefill:
                log.warning(
                    "recovering request from a lost worker", rid=record.rid, worker=worker_id, why=why
                )
                self.resume(record, "worker_lost")

    # -- changes of placement ------------------------------------------------------------------------
    def resume(self, record: RequestRecord, cause: str) -> None:
        """New generation back through prefill with every streamed token as output_token_ids."""
        if record.stats.preemptions >= self.max_resumes:
            error = unavailable(
                "WORKER_LOST", f"the request was resumed {self.max_resumes} times and failed again"
            )
            self.cancel(record, AbortReason.ABORT_REASON_REPLACED, EndEvent(error))
            return
        old_generation, old_owners = record.generation, record.owners
        self.table.bump(record)
        for worker_id in old_owners:
            self._abort(worker_id, record.rid, old_generation, AbortReason.ABORT_REASON_REPLACED)
        self.parked.pop(record.rid, None)
        record.state, record.prefill_worker, record.decode_worker = RequestState.QUEUED, None, None
        record.stats.preemptions += 1
        record.enqueued_at = time.monotonic()
        self.metrics.resumes.labels(cause).inc()
        self.queue.push(record, resumed=True)
        self.pump()

    def cancel(self, record: RequestRecord, reason: Reason, event: EndEvent | None = None) -> None:
        """End the request now: bump, Abort (new generation, covering all older) to its owners, remove."""
        if record.ended:
            return
        generation = self.table.bump(record)
        for worker_id in record.owners:
            self._abort(worker_id, record.rid, generation, reason)
        self.queue.remove(record)
        self.parked.pop(record.rid, None)
        self.table.end(record, event)
        self.metrics.queue_depth.set(len(self.queue))

    def _abort(self, worker_id: str, rid: int, generation: int, reason: Reason) -> None:
        # a STALE worker is told too: if it is only slow, it must still release the blocks
        if self.registry.get(worker_id) is not None:
            self.post(
                worker_id, envelope(abort=control_pb2.Abort(rid=rid, generation=generation, reason=reason))
            )
