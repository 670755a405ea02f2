"""The decode worker's role (and the colocated worker's): reserve, receive, batch, stream, preempt.

Decode with a prefill peer (disaggregated):

    Decode ──► reserve blocks for prompt + output, all or nothing (own prefix-cache hits first)
           ├─ short ──► ReserveFailed to the coordinator at once (nothing held)
           └─ ok ─────► kvtransfer RecvSession posts receives into exactly those blocks, then
                        Reserved to P; queue lease armed (--queue-lease-ms: P's queue may be long)
    PrefillProgress ──► P runs it: the lease (--lease-ms) starts, renewed by each one and each KVChunkReady
    KVChunkReady ──► counted (the receives are already posted); lease renewed
    (--kv-transfer-mode pull: Reserved.pull; no receives posted; each KVChunkReady names P's source
     blocks and D reads them into its reserved ones, the first one opening a PullRecvSession)
    KVDone ──► every announced chunk and every message landed?
           ├─ yes ──► joins the batch with token 1 as its next input (never recomputed); KVAck(ok);
           │          its first step about to run ──► token 1 to the coordinator (a TokenBatch item
           │          it already has from P: under --first-token-from decode, the one that streams it)
           └─ no ───► KVAck(failed) to P, Abort(PEER_FAILED) to the coordinator, blocks released
    each step ──► one TokenBatch for every request that produced a token (offsets per request)
    out of blocks ──► preempted: blocks freed, Preempted to the coordinator (it resumes via prefill)

Decode without a prefill peer (the colocated worker, `--mode colocated`, and a decode worker the
router chose to prefill locally, conditional disaggregation): the request is prefilled here with
chunked prefill, within the step budget the running decodes leave (the scheduler serves decodes
first); its first token goes out as PrefillDone, the rest as TokenBatch. A preemption re-prefills
locally on a colocated worker (the engine as is) and goes back to the coordinator on a decode worker.
Either way every record ends in the role's `_end`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import structlog

from engine.kv_manager import cdiv
from engine.scheduler import ScheduledSequence
from engine.sequence import Sequence
from engine.step_cost import ema
from engine.worker.convert import engine_request_id, sampling_params, tokens_message
from engine.worker.record import WorkerRequest
from engine.worker.role import WorkerParts, WorkerRole
from engine.worker.stepper import StepReport
from engine.worker.transfer import TransferPlane, session_key
from kvtransfer import RecvSession, SessionAborted, SessionState, TransportError, new_session_secret
from kvtransfer.lanes import transport_label
from kvtransfer.pull import PoolSource, PullRecvSession
from kvtransfer.session import SinkSession
from splitserve import wire
from splitserve.control import Received
from splitserve.v1 import control_pb2, serving_pb2

log = structlog.get_logger(__name__)
PEER_FAILED = control_pb2.ABORT_REASON_PEER_FAILED


@dataclass(slots=True, eq=False)
class DecodeRequest(WorkerRequest):
    """A request on the decode worker. `peer` is its prefill worker (None: prefilled here).
    `reserved_blocks` are the ids sent in Reserved (KV positions from `kv_start_token` on)."""

    reserved_blocks: list[int] = field(default_factory=list)
    kv_start_token: int = 0
    session: SinkSession | None = None
    pull: bool = False  # D reads the KV itself (Reserved.pull); the session opens at chunk 0
    transfer_secret: bytes = b""  # the session's secret, sent in Reserved; both sides build with it
    release_session: Callable[[list[int]], None] | None = None
    chunks: set[int] = field(default_factory=set)
    first_chunk_at: float | None = None
    kv_done: control_pb2.KVDone | None = None
    kv_done_at: float | None = None
    running: bool = False
    announced: bool = False  # token 1 re-sent to the coordinator as this worker's first step started
    first_token_sent: bool = False
    kv_transfer_ms: float | None = None


class DecodeWorker(WorkerRole):
    """Owns the decode worker's requests (`records`: rid -> DecodeRequest) and their reservations."""

    def __init__(self, parts: WorkerParts) -> None:
        super().__init__(parts)
        self.plane: TransferPlane | None = parts.transfer
        self.colocated = self.settings.role == "colocated"
        self.block_size = self.engine.config.block_size
        self.kv_transfer_ms = 0.0  # moving average of KVDone.kv_transfer_ms, for the router

    # --- coordinator messages -----------------------------------------------------------------------

    async def handle_decode(self, msg: Received) -> None:
        d = msg.envelope.decode
        req = d.request
        if not self.supersede(req, "decode"):
            return
        remote = bool(d.prefill.worker_id)
        if not self.accepting:
            await self._reserve_failed(req, 0)  # draining: the coordinator places it elsewhere
            return
        why = self.refusal(req) or (None if self.plane or not remote else "this worker receives no KV")
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
        """All or nothing (`LLMEngine.reserve`): own prefix-cache hits, then fresh blocks for the rest."""
        ids = self.engine.reserve(r.seq)
        if ids is None:
            await self._reserve_failed(r.req, self.engine.num_free_blocks)
            return
        r.reserved_blocks, r.kv_start_token = ids, r.seq.num_cached_tokens
        self.track(r)
        # a waiting P is the coordinator's to judge first (a stale P's requests are resumed); this
        # bounds the reservation even when nobody tells us
        queue_ms = self.settings.queue_lease_ms
        self.rearm_lease(r, "the prefill worker did not start it within --queue-lease-ms", queue_ms)
        assert self.plane is not None and r.peer is not None
        try:
            peer = await self.plane.peer(r.peer)
        except TransportError as exc:
            await self.fail(r, PEER_FAILED, f"no KV connection to the prefill worker: {exc}")
            return
        if not self.is_current(r):
            return  # aborted while connecting
        secret = r.transfer_secret = new_session_secret()  # goes out in Reserved only
        r.pull = self.plane.pulls_over(peer)
        if not r.pull:
            r.release_session = self.plane.hold(ids)
            key = session_key(r.rid, r.generation)
            queued = replace(self.plane.config, lease_s=max(queue_ms, self.settings.lease_ms) / 1e3)
            r.session = RecvSession(peer, key, secret, self.plane.cache, ids, r.release_session, queued)
            r.session.start()  # receives posted before P can learn the block ids
            self.spawn(self._receive, r, r.session)
        reserved = control_pb2.Reserved(
            rid=r.rid,
            generation=r.generation,
            decode_worker_id=self.settings.worker_id,
            block_ids=wire.pack_ids(ids),
            kv_start_token=r.kv_start_token,
            lease_ms=self.settings.lease_ms,
            transfer_secret=secret,
            pull=r.pull,
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

    def _progress(self, r: DecodeRequest) -> None:
        """P moved the request on: the lease (ours and the session's) runs --lease-ms from now."""
        self.rearm_lease(r, "no KV progress from the prefill worker within the lease")
        if r.session is not None:
            r.session.renew(self.settings.lease_ms / 1e3)

    async def handle_prefill_progress(self, msg: Received) -> None:
        s = msg.envelope.prefill_progress
        r: DecodeRequest | None = self.current(s.rid, s.generation, "prefill_progress", msg.sender)
        if r is not None and r.kv_done is None:
            self._progress(r)

    async def handle_kv_chunk_ready(self, msg: Received) -> None:
        c = msg.envelope.kv_chunk_ready
        r: DecodeRequest | None = self.current(c.rid, c.generation, "kv_chunk_ready", msg.sender)
        if r is None or r.kv_done is not None:
            return
        end = c.first_block + c.num_blocks
        if c.chunk_index in r.chunks or end > len(r.reserved_blocks) or c.num_blocks == 0:
            await self.fail(
                r, PEER_FAILED, f"chunk {c.chunk_index} (blocks {c.first_block}..{end}) is invalid"
            )
            return
        r.chunks.add(c.chunk_index)
        self._progress(r)
        if r.first_chunk_at is None:
            r.first_chunk_at = time.monotonic()
        if r.pull:
            await self._pull_chunk(r, c)

    async def _pull_chunk(self, r: DecodeRequest, c: control_pb2.KVChunkReady) -> None:
        """Pull: read the chunk's blocks from P (one get per coalesced run, kvtransfer.pull); the
        first chunk opens the session with the pool it names."""
        assert self.plane is not None and r.peer is not None
        try:
            src = wire.unpack_ids(c.src_block_ids)
            if len(src) != c.num_blocks:
                raise ValueError(f"chunk {c.chunk_index} names {len(src)} source blocks for {c.num_blocks}")
            if r.session is None:
                if not c.HasField("pool"):
                    raise ValueError("the first chunk names no KV pool to read")
                # the connection _reserve opened (no await here: chunks arrive back to back)
                peer = self.plane.transport.peer(r.peer.transfer_address)
                if peer is None or peer.lost:
                    raise TransportError("the KV connection to the prefill worker is gone")
                source = PoolSource(c.pool.rkey, c.pool.base, c.pool.length)
                r.release_session = self.plane.hold(r.reserved_blocks)
                key, cache = session_key(r.rid, r.generation), self.plane.cache
                r.session = PullRecvSession(
                    peer, key, r.transfer_secret, cache, r.reserved_blocks, r.release_session,
                    self.plane.mapped_pool(), source, self.plane.config,
                )  # fmt: skip
                self.spawn(self._receive, r, r.session)
            assert isinstance(r.session, PullRecvSession)
            r.session.pull(c.first_block, src)
        except (ValueError, TransportError, SessionAborted) as exc:
            await self.fail(r, PEER_FAILED, f"KV pull failed: {exc}")

    async def handle_kv_done(self, msg: Received) -> None:
        k = msg.envelope.kv_done
        r: DecodeRequest | None = self.current(k.rid, k.generation, "kv_done", msg.sender)
        if r is None or r.kv_done is not None or r.peer is None or (r.session is None and not r.pull):
            return
        r.kv_done, r.kv_done_at = k, time.monotonic()
        if k.finish_reason != serving_pb2.FINISH_REASON_UNSPECIFIED:
            # token 1 ended it (P reported it): nothing to generate; the receives are cancelled
            await self.to_peer(r.peer, kv_ack=control_pb2.KVAck(rid=r.rid, generation=r.generation, ok=True))
            self._end(r, "finished")
            return
        error = None
        if k.num_tokens != r.num_kv_tokens:
            error = f"KVDone covers {k.num_tokens} tokens, the sequence has {r.num_kv_tokens}"
        elif len(r.chunks) != k.num_chunks:
            error = f"KVDone counts {k.num_chunks} chunks, {len(r.chunks)} were announced"
        elif r.session is None:
            error = "KVDone before any chunk"
        if error is not None:
            ack = control_pb2.KVAck(rid=r.rid, generation=r.generation, ok=False, error=error)
            await self.to_peer(r.peer, kv_ack=ack)
            await self.fail(r, PEER_FAILED, error)
            return
        self.rearm_lease(r, "KV not landed within the lease")  # now it bounds the last receives
        assert r.session is not None
        r.session.renew(self.settings.lease_ms / 1e3)
        r.session.mark_done(k.token_id)

    async def _receive(self, r: DecodeRequest, session: SinkSession) -> None:
        """Wait for the session's end: every message landed after KVDone (join the batch), or abort."""
        try:
            token = await session.wait()  # the transfer's end; bounded by the session's and our lease
        except SessionAborted as exc:
            if r.session is session:
                await self.fail(r, PEER_FAILED, f"KV transfer failed: {exc.reason}")
            return
        if not self.is_current(r) or r.peer is None or token is None:
            return
        assert r.release_session is not None and r.kv_done is not None
        r.release_session(r.reserved_blocks)  # kvtransfer releases only on abort: DONE's go here
        self.rearm_lease(r, None)
        assert self.plane is not None
        transport = transport_label(session.peer.transports)
        self.metrics.transfer_bytes.labels("recv", transport).inc(
            len(r.reserved_blocks) * self.plane.block_bytes
        )
        self.metrics.transfer_chunks.labels("recv", transport).inc(len(r.chunks))
        if r.first_chunk_at is not None:
            self.metrics.transfer_seconds.labels("recv", transport).observe(
                time.monotonic() - r.first_chunk_at
            )
        r.log.info("kv received", blocks=len(r.reserved_blocks), chunks=len(r.chunks), transport=transport)
        await self.to_peer(r.peer, kv_ack=control_pb2.KVAck(rid=r.rid, generation=r.generation, ok=True))
        kv_ms = r.kv_done.kv_transfer_ms
        if r.pull and r.kv_done_at is not None:  # P's part ends at KVDone; the last reads are ours
            kv_ms += (time.monotonic() - r.kv_done_at) * 1e3
        r.running, r.first_token_sent, r.kv_transfer_ms = True, True, kv_ms
        self.kv_transfer_ms = ema(self.kv_transfer_ms, kv_ms)
        self.engine.join(r.seq, token)
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

    async def on_scheduled(self, scheduled: list[ScheduledSequence]) -> None:
        """Announce each shipped request at its first step here: its token 1 (the coordinator has it
        from P; under --first-token-from decode this is what streams it), just before the forward,
        so the client's first gap is this one step."""
        items = []
        for item in scheduled:
            r: DecodeRequest | None = self.of_seq(item.seq)
            if r is not None and r.peer is not None and r.running and not r.announced:
                r.announced = True
                seq = r.seq
                items.append(
                    tokens_message(r.rid, r.generation, seq.num_output_tokens - 1, seq.token_ids[-1:])
                )
        if items:
            await self.to_coordinator(
                token_batch=control_pb2.TokenBatch(worker_id=self.settings.worker_id, items=items)
            )

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

    def _release(self, rec: WorkerRequest, outcome: str) -> None:
        assert isinstance(rec, DecodeRequest)
        if rec.session is not None and rec.release_session is not None:
            if rec.session.state is SessionState.DONE:
                rec.release_session(rec.reserved_blocks)  # landed, maybe not yet joined: drop them now
            else:
                rec.session.abort(outcome)  # its references go once every posted receive ended
        self.stepper.release(rec.seq)

    def peer_needs_abort(self, rec: WorkerRequest) -> bool:
        return isinstance(rec, DecodeRequest) and rec.peer is not None and not rec.running

    def load(self) -> serving_pb2.WorkerLoad:
        load = super().load()
        load.kv_transfer_ms = self.kv_transfer_ms
        return load

    def queue_depths(self) -> dict[str, int]:
        waiting_kv = sum(
            1 for r in self.records.values() if isinstance(r, DecodeRequest) and r.peer and not r.running
        )
        return super().queue_depths() | {"reserved": waiting_kv}
