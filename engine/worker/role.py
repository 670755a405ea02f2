"""What the prefill and decode roles share: the request table, dispatch, checks, timers, sends.

A role owns its request table (rid -> WorkerRequest; one generation per rid: a newer generation
replaces the older one, an older one is dropped and counted). Every record is created by a
coordinator message and removed by exactly one `_end` call (finished, aborted, expired, preempted,
failed), which releases its blocks through the role's `_release`. `idle` is set whenever the table is
empty, so a draining worker waits on an event instead of polling.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

import structlog

from engine.config import EngineConfig, long_prompt
from engine.llm_engine import LLMEngine, StepOutput
from engine.scheduler import ScheduledSequence
from engine.sequence import Sequence
from engine.worker.convert import finish_reason, tokens_message
from engine.worker.metrics import WorkerMetrics
from engine.worker.record import WorkerRequest
from engine.worker.runtime import WorkerControl
from engine.worker.settings import WorkerSettings
from engine.worker.stepper import StepLoop, StepReport
from engine.worker.transfer import TransferPlane
from splitserve.control import ControlQueueFull, Received, envelope
from splitserve.logs import RateLimitedLog
from splitserve.v1 import control_pb2, serving_pb2

log = structlog.get_logger(__name__)
Reason: TypeAlias = control_pb2.AbortReason.ValueType
_FROM_COORDINATOR = frozenset({"prefill", "decode", "reassign", "abort"})
_FROM_PEERS = frozenset({"reserved", "prefill_progress", "kv_chunk_ready", "kv_done", "kv_ack", "abort"})


@dataclass(slots=True)
class WorkerParts:
    """The parts of one worker a role works with; built by `engine.worker.process.Worker`."""

    settings: WorkerSettings
    engine: LLMEngine
    stepper: StepLoop
    control: WorkerControl
    metrics: WorkerMetrics
    transfer: TransferPlane | None  # the bulk KV plane; None on a colocated worker


class WorkerRole:
    """Base class; subclasses implement `handle_<kind>` for the messages they accept, `_release`, and the
    StepHandler methods, and may override `engine_config` for their engine policy."""

    @classmethod
    def engine_config(cls, config: EngineConfig) -> EngineConfig:
        """The engine config this role's worker runs (the flags' config plus the role's policy)."""
        return config

    def __init__(self, parts: WorkerParts) -> None:
        self.settings, self.engine, self.stepper = parts.settings, parts.engine, parts.stepper
        self.control, self.metrics = parts.control, parts.metrics
        engine = parts.engine
        self.eos_token_ids = engine.loaded.config.eos_token_ids
        self.accepting = True
        self.idle = asyncio.Event()
        self.idle.set()
        self.records: dict[int, WorkerRequest] = {}
        self._by_seq: dict[str, WorkerRequest] = {}
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self._background: set[asyncio.Task[Any]] = set()
        self._unexpected = RateLimitedLog(
            "control input dropped", at=f"{parts.settings.role} role"
        )  # rate-limited: peers may flood
        parts.stepper.handler = self  # type: ignore[assignment]  # subclasses implement StepHandler

    # --- dispatch and the request table -------------------------------------------------------------

    async def handle(self, msg: Received) -> None:
        """Dispatch to `handle_<kind>`; a message from the wrong side (a peer sending what only the
        coordinator may send, or the reverse) or of a kind this role does not take is dropped."""
        allowed = _FROM_PEERS if msg.sender else _FROM_COORDINATOR
        handler = getattr(self, f"handle_{msg.kind}", None) if msg.kind in allowed else None
        if handler is None:
            self._unexpected("unexpected_kind", kind=msg.kind, sender=msg.sender)
            self.metrics.control_dropped.labels(
                "peers" if msg.sender else "coordinator", "unexpected_kind"
            ).inc()
            return
        await handler(msg)

    def supersede(self, req: control_pb2.ExecutionRequest, kind: str) -> bool:
        """Make room for a new (rid, generation); False (counted) when we hold that or a newer one."""
        old = self.records.get(req.rid)
        if old is None:
            return True
        if old.generation >= req.generation:
            self.metrics.stale_messages.labels(kind).inc()
            return False
        self._end(old, "replaced")
        return True

    def current(self, rid: int, generation: int, kind: str, sender: str | None = None) -> Any:
        """The record for exactly (rid, generation) from its peer `sender`, else None (counted)."""
        rec = self.records.get(rid)
        ok = rec is not None and rec.generation == generation
        if ok and sender is not None:  # P<->D messages must come from the request's peer
            ok = rec is not None and rec.peer is not None and rec.peer.worker_id == sender
        if not ok:
            self.metrics.stale_messages.labels(kind).inc()
            return None
        return rec

    def track(self, rec: WorkerRequest) -> None:
        self.records[rec.rid] = rec
        self._by_seq[rec.seq.request_id] = rec
        self.idle.clear()
        deadline = self.deadline_in(rec.req)
        if deadline is not None:
            rec.deadline = self.later(
                deadline, self.fail, rec, control_pb2.ABORT_REASON_DEADLINE_EXCEEDED, "deadline passed"
            )

    def of_seq(self, seq_or_id: Sequence | str) -> Any:
        key = seq_or_id if isinstance(seq_or_id, str) else seq_or_id.request_id
        return self._by_seq.get(key)

    def is_current(self, rec: WorkerRequest) -> bool:
        return self.records.get(rec.rid) is rec

    def _end(self, rec: WorkerRequest, outcome: str) -> None:
        """The one exit of a record: disarm its timers and release its blocks (`_release`). Idempotent."""
        if not self.is_current(rec):
            return
        del self.records[rec.rid]
        del self._by_seq[rec.seq.request_id]
        rec.disarm()
        self._release(rec, outcome)
        self.metrics.requests.labels(outcome).inc()
        if not self.records:
            self.idle.set()
        rec.log.debug("released", outcome=outcome)

    def _release(self, rec: WorkerRequest, outcome: str) -> None:
        """End the record's transfer (if any) and give its blocks back; called once, by `_end`."""
        raise NotImplementedError

    def peer_needs_abort(self, rec: WorkerRequest) -> bool:
        """Whether the peer still holds state for this record (an open transfer)."""
        return False

    async def fail(self, rec: WorkerRequest, reason: Reason, message: str) -> None:
        """This worker gives up on `rec`: end it, tell the peer (if it holds state) and the coordinator."""
        if not self.is_current(rec):
            return
        tell_peer = rec.peer is not None and self.peer_needs_abort(rec)
        name = control_pb2.AbortReason.Name(reason)
        rec.log.info("giving up", reason=name, message=message)
        self._end(rec, name.removeprefix("ABORT_REASON_").lower())
        abort = control_pb2.Abort(rid=rec.rid, generation=rec.generation, reason=reason, message=message)
        if tell_peer and rec.peer is not None:
            await self.to_peer(rec.peer, abort=abort)
        await self.to_coordinator(abort=abort)

    async def handle_abort(self, msg: Received) -> None:
        a = msg.envelope.abort
        rec = self.records.get(a.rid)
        if rec is not None and msg.sender and (rec.peer is None or rec.peer.worker_id != msg.sender):
            self.metrics.stale_messages.labels("abort").inc()  # from a worker that is not its peer (now)
            return
        if rec is not None and rec.generation <= a.generation:
            rec.log.info(
                "aborted", reason=control_pb2.AbortReason.Name(a.reason), by=msg.sender or "coordinator"
            )
            self._end(rec, "aborted")

    async def on_peers_lost(self, worker_ids: set[str]) -> None:
        for rec in list(self.records.values()):
            if rec.peer is not None and rec.peer.worker_id in worker_ids and self.peer_needs_abort(rec):
                await self.fail(rec, control_pb2.ABORT_REASON_PEER_FAILED, f"peer {rec.peer.worker_id} left")

    async def on_scheduled(self, scheduled: list[ScheduledSequence]) -> None:
        """Called before each forward (the decode role announces the requests it starts decoding)."""

    async def on_step_failed(self, seqs: list[Sequence], error: BaseException) -> None:
        for seq in seqs:
            rec = self.of_seq(seq)
            if rec is not None:
                await self.fail(rec, control_pb2.ABORT_REASON_WORKER_ERROR, f"model step failed: {error}")

    async def abort_all(self, reason: Reason, message: str) -> None:
        for rec in list(self.records.values()):
            await self.fail(rec, reason, message)

    # --- request checks, first tokens, load -----------------------------------------------------------

    def refusal(self, req: control_pb2.ExecutionRequest) -> str | None:
        """Why this worker cannot run `req` at all (None: it can)."""
        identity = self.engine.loaded.identity
        if req.model_identity and req.model_identity != identity:
            return f"model_identity {req.model_identity[:12]} differs from this worker's {identity[:12]}"
        if req.deadline_unix_ns and req.deadline_unix_ns <= time.time_ns():
            return "deadline already passed"
        return None

    @staticmethod
    def deadline_in(req: control_pb2.ExecutionRequest) -> float | None:
        """Seconds until the request's deadline, or None when it has none."""
        if not req.deadline_unix_ns:
            return None
        return max(0.0, (req.deadline_unix_ns - time.time_ns()) / 1e9)

    def note_started(self, report: StepReport) -> None:
        """Stamp the first step of each record (queue time ends there) and count prefix-cache hits."""
        begun = time.monotonic() - report.seconds
        for item in report.out.scheduled:
            rec = self.of_seq(item.seq)
            if rec is not None and rec.started is None:
                rec.started = begun
                self.prefix_query_tokens += rec.num_kv_tokens
                self.prefix_hit_tokens += rec.seq.num_cached_tokens

    def step_tokens(self, rec: WorkerRequest, out: StepOutput) -> control_pb2.Tokens:
        """The `Tokens` item of one step output (the token just appended to `rec.seq`)."""
        want_lp = rec.req.HasField("logprobs")
        return tokens_message(
            rec.rid,
            rec.generation,
            rec.seq.num_output_tokens - len(out.new_token_ids),
            out.new_token_ids,
            out.new_logprobs if want_lp else None,
            out.top_logprobs,
            rec.req.logprobs if want_lp else 0,
            finish_reason(rec.seq, self.eos_token_ids)
            if out.finished
            else serving_pb2.FINISH_REASON_UNSPECIFIED,
        )

    async def send_prefill_done(self, rec: WorkerRequest, out: StepOutput) -> control_pb2.Tokens:
        """PrefillDone for the first token of `rec` (sampled by this worker's prefill), sent at once."""
        now = time.monotonic()
        started = rec.started if rec.started is not None else now
        tokens = self.step_tokens(rec, out)
        cached = rec.seq.num_cached_tokens
        done = control_pb2.PrefillDone(
            output=tokens,
            cached_tokens=cached,
            computed_tokens=rec.num_kv_tokens - cached,
            queue_ms=(started - rec.arrived) * 1e3,
            prefill_ms=(now - started) * 1e3,
        )
        await self.to_coordinator(prefill_done=done)
        return tokens

    def queue_depths(self) -> dict[str, int]:
        return {"waiting": len(self.engine.scheduler.waiting), "running": len(self.engine.scheduler.running)}

    def load(self) -> serving_pb2.WorkerLoad:
        sched, config = self.engine.scheduler, self.engine.config
        prompt_left = sched.prompt_tokens_left()
        threshold = config.long_prefill_token_threshold
        beside_base_ms, beside_ms_per_token = sched.prompt_cost
        return serving_pb2.WorkerLoad(
            queued_requests=len(sched.waiting),
            queued_tokens=sum(prompt_left),
            queued_long_tokens=sum(n for n in prompt_left if long_prompt(threshold, n)),
            long_prefill_token_threshold=threshold,
            short_prompts_whole=config.short_prompts_whole,
            running_requests=len(sched.running),
            step_token_budget=config.max_num_batched_tokens,
            prefill_tokens_while_decoding=sched.prompt_tokens_while_decoding(),
            prefill_us_per_token=self.engine.step_cost.us_per_token,
            step_base_ms=self.engine.step_cost.base_ms,
            decode_step_ms=self.engine.decode_step_ms,
            prompt_beside_decodes_us_per_token=beside_ms_per_token * 1e3,
            prompt_beside_decodes_base_ms=beside_base_ms,
            prompt_on_borrowed_cores_us_per_token=self.engine.borrowed_prompt_cost.us_per_token,
            prompt_on_borrowed_cores_base_ms=self.engine.borrowed_prompt_cost.base_ms,
            prefill_tokens_while_decoding_on_borrowed_cores=self.engine.prompt_tokens_while_decoding_widened(),
            prompt_on_borrowed_cores_share=leases.widened_share if (leases := self.stepper.leases) else 0.0,
            prefix_cache_query_tokens=self.prefix_query_tokens,
            prefix_cache_hit_tokens=self.prefix_hit_tokens,
        )

    # --- timers, tasks, sends -------------------------------------------------------------------------

    def later(self, delay_s: float, fn: Callable[..., Awaitable[None]], *args: Any) -> asyncio.TimerHandle:
        """Run `fn(*args)` as a task after `delay_s` (a lease or a deadline); cancel the handle to disarm."""
        return asyncio.get_running_loop().call_later(delay_s, self.spawn, fn, *args)

    def rearm_lease(self, rec: WorkerRequest, message: str | None, lease_ms: int | None = None) -> None:
        """Replace `rec`'s lease: after `lease_ms` (default --lease-ms) it fails with LEASE_EXPIRED
        (`message` None: disarm)."""
        if rec.lease is not None:
            rec.lease.cancel()
            rec.lease = None
        if message is not None:
            lease_s = (lease_ms or self.settings.lease_ms) / 1e3
            rec.lease = self.later(lease_s, self.fail, rec, control_pb2.ABORT_REASON_LEASE_EXPIRED, message)

    def spawn(self, fn: Callable[..., Awaitable[None]], *args: Any) -> asyncio.Task[None]:
        """Run `fn(*args)` as a task the role keeps a reference to; failures are logged."""
        task: asyncio.Task[None] = asyncio.ensure_future(fn(*args))
        self._background.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed", exc_info=task.exception())

    async def to_coordinator(self, **msg: Any) -> None:
        await self.control.to_coordinator(envelope(**msg))

    async def to_peer(self, endpoint: control_pb2.WorkerEndpoint, **msg: Any) -> bool:
        """Send to a peer worker; False (logged) when its queue is full, i.e. the peer failed."""
        try:
            await self.control.to_peer(endpoint, envelope(**msg))
            return True
        except ControlQueueFull as exc:
            log.warning("peer not reading", peer=endpoint.worker_id, error=str(exc))
            return False

    async def abort_to_coordinator(
        self, req: control_pb2.ExecutionRequest, reason: Reason, message: str
    ) -> None:
        """Refuse a request this worker never took on."""
        log.warning(
            "request refused", rid=req.rid, reason=control_pb2.AbortReason.Name(reason), message=message
        )
        abort = control_pb2.Abort(rid=req.rid, generation=req.generation, reason=reason, message=message)
        await self.to_coordinator(abort=abort)
