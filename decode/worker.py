"""The decode worker's role (and the colocated worker's): reserve, receive, batch, stream, preempt.

Decode with a prefill peer (disaggregated):

    Decode ──► reserve blocks for prompt + output, all or nothing (own prefix-cache hits first)
           ├─ short ──► ReserveFailed to the coordinator at once (nothing held)
           └─ ok ─────► receives posted into exactly those blocks; Reserved to P; lease armed
    KVChunkReady ──► receive of that chunk posted        KVDone ──► every chunk arrived?
           ├─ yes ──► joins the batch with token 1 as its next input (never recomputed); KVAck(ok)
           └─ no ───► KVAck(failed) to P, Abort(PEER_FAILED) to the coordinator, blocks released
    each step ──► one TokenBatch for every request that produced a token (offsets per request)
    out of blocks ──► preempted: blocks freed, Preempted to the coordinator (it resumes via prefill)

Decode without a prefill peer (the colocated worker, `--mode colocated`): the request is prefilled
here with chunked prefill; its first token goes out as PrefillDone, the rest as TokenBatch, and a
preemption re-prefills locally (the engine as is). Either way every record ends in the role's `_end`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import structlog

from decode.receiving import KVReceiver
from engine.kv_manager import cdiv
from engine.llm_engine import LLMEngine
from engine.sequence import Sequence
from engine.worker.convert import engine_request_id, sampling_params
from engine.worker.metrics import WorkerMetrics
from engine.worker.role import RequestRecord, WorkerRole
from engine.worker.runtime import ControlPlane
from engine.worker.settings import WorkerSettings
from engine.worker.stepper import StepLoop, StepReport
from splitserve import wire
from splitserve.control import Received
from splitserve.v1 import control_pb2, serving_pb2

log = structlog.get_logger(__name__)
PEER_FAILED = control_pb2.ABORT_REASON_PEER_FAILED


@dataclass(slots=True, eq=False)
class DecodeRequest(RequestRecord):
    """A request on the decode worker. `peer` is its prefill worker (None: prefilled here).
    `reserved_blocks` are the ids sent in Reserved (KV positions from `kv_start_token` on)."""

    reserved_blocks: list[int] = field(default_factory=list)
    kv_start_token: int = 0
    chunks: set[int] = field(default_factory=set)
    kv_done: bool = False
    running: bool = False
    first_token_sent: bool = False
    kv_transfer_ms: float | None = None


class DecodeWorker(WorkerRole):
    """Owns the decode worker's requests (`records`: rid -> DecodeRequest) and their reservations."""

    def __init__(
        self,
        settings: WorkerSettings,
        engine: LLMEngine,
        stepper: StepLoop,
        control: ControlPlane,
        metrics: WorkerMetrics,
        receiver: KVReceiver | None,
    ) -> None:
        super().__init__(settings, engine, stepper, control, metrics)
        self.receiver = receiver
        self.colocated = settings.role == "colocated"
        self.block_size = engine.pool.block_size

    # --- coordinator messages -----------------------------------------------------------------------

    async def on_decode(self, msg: Received) -> None:
        d = msg.envelope.decode
        req = d.request
        if not self.supersede(req, "decode"):
            return
        remote = bool(d.prefill.worker_id)
        if not self.accepting:
            await self._reserve_failed(req, 0)  # draining: the coordinator places it elsewhere
            return
        why = self.refusal(req) or (None if self.receiver or not remote else "this worker receives no KV")
        seq = None
        if why is None:
            try:
                prompt, output = wire.unpack_ids(req.prompt_token_ids), wire.unpack_ids(req.output_token_ids)
                rid, params = engine_request_id(req.rid, req.generation), sampling_params(req)
                if remote:
                    seq = self.engine.new_sequence(rid, prompt, params, output)
                else:  # prefilled here, queued at once
                    seq = self.engine.add_request(rid, prompt, params, output)
            except ValueError as exc:
                why = str(exc)
        if why is not None or seq is None:
            await self.abort_to_coordinator(req, control_pb2.ABORT_REASON_WORKER_ERROR, why or "")
            return
        bound = log.bind(rid=req.rid, request_id=req.request_id)
        if remote:
            await self._reserve(DecodeRequest(req, seq, d.prefill, bound))
        else:
            self.track(DecodeRequest(req, seq, None, bound))
            self.stepper.wake()

    async def _reserve(self, r: DecodeRequest) -> None:
        """All or nothing: own prefix-cache hits, then fresh blocks for the rest of the sequence's KV."""
        seq, kv = r.seq, self.engine.kv
        hit = kv.match_prefix(seq)
        need = cdiv(seq.num_tokens, self.block_size) - len(seq.block_table)
        ids = self.engine.pool.allocate(need)
        if ids is None:
            kv.free(seq)
            seq.num_computed_tokens = seq.num_cached_tokens = 0
            await self._reserve_failed(r.req, self.engine.pool.num_free_blocks)
            return
        seq.block_table.extend(ids)
        r.reserved_blocks, r.kv_start_token = ids, hit
        self.track(r)
        assert self.receiver is not None and r.peer is not None
        await self.receiver.open(r)
        self.rearm_lease(r, "no KVDone within the lease")
        reserved = control_pb2.Reserved(
            rid=r.rid,
            generation=r.generation,
            decode_worker_id=self.settings.worker_id,
            block_ids=wire.pack_ids(ids),
            kv_start_token=hit,
            lease_ms=self.settings.lease_ms,
        )
        if not await self.to_peer(r.peer, reserved=reserved):
            await self.fail(r, PEER_FAILED, "prefill worker not reading")

    async def _reserve_failed(self, req: control_pb2.ExecutionRequest, available: int) -> None:
        num_tokens = wire.ids_array(req.prompt_token_ids).size + wire.ids_array(req.output_token_ids).size
        needed = cdiv(num_tokens, self.block_size)
        log.info("reservation refused", rid=req.rid, needed=needed, available=available)
        self.metrics.requests.labels("reserve_failed").inc()
        failed = control_pb2.ReserveFailed(
            rid=req.rid,
            generation=req.generation,
            decode_worker_id=self.settings.worker_id,
            needed_blocks=needed,
            available_blocks=available,
        )
        await self.to_coordinator(reserve_failed=failed)

    # --- prefill worker messages --------------------------------------------------------------------

    async def on_kv_chunk_ready(self, msg: Received) -> None:
        c = msg.envelope.kv_chunk_ready
        r: DecodeRequest | None = self.current(c.rid, c.generation, "kv_chunk_ready", msg.sender)
        if r is None or r.running:
            return
        end = c.first_block + c.num_blocks
        if c.chunk_index in r.chunks or end > len(r.reserved_blocks) or c.num_blocks == 0:
            await self.fail(
                r, PEER_FAILED, f"chunk {c.chunk_index} (blocks {c.first_block}..{end}) is invalid"
            )
            return
        r.chunks.add(c.chunk_index)
        assert self.receiver is not None
        await self.receiver.post(r, c.chunk_index, r.reserved_blocks[c.first_block : end])

    async def on_kv_done(self, msg: Received) -> None:
        k = msg.envelope.kv_done
        r: DecodeRequest | None = self.current(k.rid, k.generation, "kv_done", msg.sender)
        if r is None or r.kv_done:
            self.metrics.stale_messages.labels("kv_done").inc()
            return
        r.kv_done = True
        self.rearm_lease(r, "receives not done within the lease")  # now it bounds the last receives
        self.spawn(self._join, r, k)

    async def _join(self, r: DecodeRequest, k: control_pb2.KVDone) -> None:
        assert self.receiver is not None and r.peer is not None
        error = await self.receiver.wait(r, k.num_chunks)  # protects an invariant: decode only on landed KV
        if not self.is_current(r):
            return
        if error is None and k.num_tokens != r.num_kv_tokens:
            error = f"KVDone covers {k.num_tokens} tokens, the sequence has {r.num_kv_tokens}"
        if error is None and len(r.chunks) != k.num_chunks:
            error = f"{len(r.chunks)} of {k.num_chunks} chunks announced"
        await self.to_peer(
            r.peer,
            kv_ack=control_pb2.KVAck(rid=r.rid, generation=r.generation, ok=error is None, error=error or ""),
        )
        if error is not None:
            await self.fail(r, PEER_FAILED, error)
            return
        self.receiver.close(r, ok=True)
        self.rearm_lease(r, None)
        if k.finish_reason != serving_pb2.FINISH_REASON_UNSPECIFIED:
            self._end(r, "finished")  # token 1 ended it: P reported it, nothing to generate
            return
        seq = r.seq
        seq.num_computed_tokens = seq.num_tokens
        seq.token_ids.append(k.token_id)
        r.running, r.first_token_sent, r.kv_transfer_ms = True, True, k.kv_transfer_ms
        self.engine.add_running(seq)
        self.stepper.wake()

    # --- engine -------------------------------------------------------------------------------------

    async def on_preempted(self, seqs: list[Sequence]) -> None:
        if self.colocated:
            return  # the engine re-prefills them here
        for seq in seqs:
            r: DecodeRequest | None = self.of_seq(seq)
            if r is None:
                self.stepper.release(seq)
                continue
            self._end(r, "preempted")
            done = control_pb2.Preempted(
                rid=r.rid, generation=r.generation, num_output_tokens=seq.num_output_tokens
            )
            await self.to_coordinator(preempted=done)

    async def on_step(self, report: StepReport) -> None:
        self.note_started(report)
        items: list[control_pb2.Tokens] = []
        for out in report.outputs:
            r: DecodeRequest | None = self.of_seq(out.request_id)
            if r is None:
                continue  # ended during the step: nothing more is sent for it
            if not r.first_token_sent:
                r.first_token_sent = True
                await self.send_prefill_done(r, out)
            else:
                item = self.step_tokens(r, out)
                if r.kv_transfer_ms is not None:
                    item.kv_transfer_ms, r.kv_transfer_ms = r.kv_transfer_ms, None
                items.append(item)
            if out.finished:
                self._end(r, "finished")
        if items:
            await self.to_coordinator(
                token_batch=control_pb2.TokenBatch(worker_id=self.settings.worker_id, items=items)
            )

    # --- ending -------------------------------------------------------------------------------------

    def _release(self, rec: RequestRecord, outcome: str) -> None:
        assert isinstance(rec, DecodeRequest)
        if rec.peer is not None and self.receiver is not None:
            self.receiver.close(rec, ok=False, reason=outcome)
        self.stepper.release(rec.seq)

    def peer_needs_abort(self, rec: RequestRecord) -> bool:
        return isinstance(rec, DecodeRequest) and rec.peer is not None and not rec.running

    def queue_depths(self) -> dict[str, int]:
        waiting_kv = sum(
            1 for r in self.records.values() if isinstance(r, DecodeRequest) and r.peer and not r.running
        )
        return super().queue_depths() | {"reserved": waiting_kv}
