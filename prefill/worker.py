"""The prefill worker's role: queue, chunked prefill, first token, KV shipping, release on KVAck.

Per request (control.proto has the messages):

    Prefill ──► queued in the engine (token budget, chunked prefill across requests, prefix cache)
    a step of it ran, Reserved known ──► PrefillProgress to D, at most every lease / 4 (D's lease
      measures P's progress, not P's queue)
    Reserved known, started ──► kvtransfer SendSession into D's reserved blocks; after every prefill step the
      blocks that became final are sent (one KVChunkReady per batch) while the next chunk computes
      (Reserved.pull: a PullSendSession instead; KVChunkReady names the source blocks, D reads them)
    first token sampled ──► PrefillDone to the coordinator at once; the last blocks are sent
    all sends delivered ──► KVDone(token 1) to D ──► KVAck from D ──► blocks released (the prefix
      cache keeps them findable)

Reserved may come before Prefill (it is kept for its lease_ms). A finished prefill without a Reserved
is held under --lease-ms, then released with Abort(LEASE_EXPIRED) to the coordinator. Abort, deadline,
peer loss and a failed step end the job through the role's `_end`, the one place that releases it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import structlog

from engine.config import EngineConfig
from engine.sequence import Sequence
from engine.worker.convert import engine_request_id, finish_reason, sampling_params
from engine.worker.record import WorkerRequest
from engine.worker.role import WorkerParts, WorkerRole
from engine.worker.stepper import StepReport
from engine.worker.transfer import TransferPlane, session_key
from kvtransfer import SendSession, SessionAborted, SessionState, TransportError
from kvtransfer.lanes import transport_label
from kvtransfer.pull import PullSendSession, chunk_plan
from kvtransfer.session import SourceSession
from prefill.job import PrefillJob
from splitserve import wire
from splitserve.control import Received
from splitserve.v1 import control_pb2

log = structlog.get_logger(__name__)
PEER_FAILED = control_pb2.ABORT_REASON_PEER_FAILED


class PrefillWorker(WorkerRole):
    """Owns the prefill worker's jobs (`records`: rid -> PrefillJob) and the early Reserved messages."""

    @classmethod
    def engine_config(cls, config: EngineConfig) -> EngineConfig:
        """Finish after the first token; keep the KV past the prefill, it is shipped (then `release`)."""
        return replace(config, prefill_only=True, keep_blocks_on_finish=True)

    def __init__(self, parts: WorkerParts) -> None:
        super().__init__(parts)
        if parts.transfer is None:
            raise ValueError("a prefill worker needs a KV transfer plane")
        self.plane: TransferPlane = parts.transfer
        self.block_size = self.engine.config.block_size
        self._early: dict[int, tuple[str, control_pb2.Reserved, asyncio.TimerHandle]] = {}
        self._step_done = asyncio.Event()  # replaced after each step: a broadcast to shipping tasks

    # --- coordinator messages -----------------------------------------------------------------------

    async def handle_prefill(self, msg: Received) -> None:
        p = msg.envelope.prefill
        req = p.request
        if not self.supersede(req, "prefill"):
            return
        if not self.accepting:
            await self.abort_to_coordinator(req, control_pb2.ABORT_REASON_SHUTDOWN, "worker draining")
            return
        why = self.refusal(req)
        if why is None:
            try:
                prompt, output = wire.unpack_ids(req.prompt_token_ids), wire.unpack_ids(req.output_token_ids)
                why = self._lane_refusal(len(prompt) + len(output))
                if why is None:
                    rid = engine_request_id(req.rid, req.generation)
                    seq = self.engine.add_request(rid, prompt, sampling_params(req), output)
            except ValueError as exc:
                why = str(exc)
        if why is not None:
            await self.abort_to_coordinator(req, control_pb2.ABORT_REASON_WORKER_ERROR, why)
            return
        job = PrefillJob(req, seq, p.decode, log.bind(rid=req.rid, request_id=req.request_id))
        self.track(job)
        early = self._take_early(req.rid, req.generation, job.decode.worker_id)
        if early is not None:
            await self._attach(job, early)
        self.stepper.wake()

    def _lane_refusal(self, num_tokens: int) -> str | None:
        """Why a sequence of `num_tokens` is not this worker's to prefill (its `--max-prompt-tokens`
        lane; the router never sends one, so this is the coordinator's bug or an older one's)."""
        cap = self.settings.max_prompt_tokens
        if cap and num_tokens > cap:
            return f"{num_tokens} tokens: this worker takes sequences of at most {cap} (--max-prompt-tokens)"
        return None

    async def handle_reassign(self, msg: Received) -> None:
        r = msg.envelope.reassign
        job: PrefillJob | None = self.current(r.rid, r.generation, "reassign")
        if job is None:
            return
        if job.reserved is not None:  # the KV was going to the old decode worker: start over
            self._stop_shipping(job, "reassigned")
            job.reset_transfer()
        job.peer = r.decode
        job.log.info("decode worker reassigned", decode=r.decode.worker_id)
        self.rearm_lease(job, None)
        early = self._take_early(r.rid, r.generation, r.decode.worker_id)
        if early is not None:
            await self._attach(job, early)
        elif job.prefilled:
            self.rearm_lease(job, "no Reserved within the lease")

    async def handle_abort(self, msg: Received) -> None:
        a = msg.envelope.abort
        early = self._early.get(a.rid)
        if early is not None and early[1].generation <= a.generation:
            self._take_early(a.rid, early[1].generation, early[0])
        await super().handle_abort(msg)

    # --- decode worker messages ---------------------------------------------------------------------

    async def handle_reserved(self, msg: Received) -> None:
        r = msg.envelope.reserved
        job = self.records.get(r.rid)
        assert job is None or isinstance(job, PrefillJob)
        if r.decode_worker_id != msg.sender or (job is not None and job.generation > r.generation):
            self.metrics.stale_messages.labels("reserved").inc()
            return
        if job is None or job.generation < r.generation or job.decode.worker_id != msg.sender:
            # Reserved before Prefill, or before the Reassign naming its sender (different senders
            # race): kept for its lease, used only if that Prefill or Reassign comes
            self._stash(msg.sender, r)
            return
        if job.reserved is None:
            await self._attach(job, r)

    async def handle_kv_ack(self, msg: Received) -> None:
        k = msg.envelope.kv_ack
        job: PrefillJob | None = self.current(k.rid, k.generation, "kv_ack", msg.sender)
        if job is None:
            return
        if not k.ok:
            job.log.warning("decode worker failed to receive the KV", error=k.error)
        self._end(job, "shipped" if k.ok else "transfer_failed")

    # --- engine -------------------------------------------------------------------------------------

    async def on_preempted(self, seqs: list[Sequence]) -> None:
        """The scheduler re-queues them (no session exists before the last chunk is scheduled)."""

    async def on_step(self, report: StepReport) -> None:
        self.note_started(report)
        await self._report_progress(report)
        for out in report.outputs:
            job: PrefillJob | None = self.of_seq(out.request_id)
            if job is None:
                continue  # ended during the step
            job.token, job.sampled_at = out.new_token_ids[0], time.monotonic()
            job.finish = finish_reason(job.seq, self.eos_token_ids)
            await self.send_prefill_done(job, out)
            if job.reserved is None:  # a held result: wait for Reserved under a lease
                self.rearm_lease(job, "no Reserved within the lease")
            elif job.shipping is None:  # Reserved came during the last step
                job.shipping = self.spawn(self._ship, job)
        # after every job's token is recorded, so a woken shipper sees whether its prefill finished
        self._step_done.set()
        self._step_done = asyncio.Event()

    async def _report_progress(self, report: StepReport) -> None:
        """Every reserved job the step computed renews its session's lease and, when due, D's."""
        now = time.monotonic()
        for item in report.out.scheduled:
            job: PrefillJob | None = self.of_seq(item.seq)
            if job is None or job.reserved is None:
                continue
            if job.session is not None:
                job.session.renew()
            if job.progress_due(now):
                await self._progress_to_decode(job)

    # --- shipping -----------------------------------------------------------------------------------

    async def _attach(self, job: PrefillJob, r: control_pb2.Reserved) -> None:
        why = job.check_reserved(r, self.block_size) or self.control.links.compatible(job.decode.worker_id)
        if why is not None:
            await self.fail(job, control_pb2.ABORT_REASON_WORKER_ERROR, why)
            return
        job.reserved = r
        self.rearm_lease(job, None)
        if job.started is not None:  # else on_step says so after its first step
            await self._progress_to_decode(job)
            if not self.is_current(job):
                return  # D stopped reading: the job already failed
        job.shipping = self.spawn(self._ship, job)

    async def _progress_to_decode(self, job: PrefillJob) -> None:
        job.progress_at = time.monotonic()
        progress = control_pb2.PrefillProgress(rid=job.rid, generation=job.generation)
        if not await self.to_peer(job.decode, prefill_progress=progress):
            await self.fail(job, PEER_FAILED, "decode worker not reading")

    async def _ship(self, job: PrefillJob) -> None:
        """The job's whole transfer, from Reserved on: after each prefill step the blocks that became
        final go to D (one KVChunkReady per batch) while the next chunk computes; once token 1 is
        sampled the rest follow, then KVDone. Runs as a task that `_stop_shipping` cancels when the
        job ends first."""
        try:
            peer = await self.plane.peer(job.decode)
            while job.started is None:  # the session's lease measures the transfer, not our queue
                step_done = self._step_done
                await step_done.wait()  # protects an invariant: a lease starts when the work does
            dst, secret = job.dst_blocks(), job.transfer_secret()
            key = session_key(job.rid, job.generation)
            session: SourceSession
            if job.reserved is not None and job.reserved.pull:  # D reads the blocks itself
                session = PullSendSession(
                    peer, key, secret, self.plane.cache, [], len(dst), job.release_holds,
                    self.plane.mapped_pool(), self.plane.config,
                )  # fmt: skip
                job.session, job.messages = session, chunk_plan(len(dst))
            else:
                session = SendSession(
                    peer, key, secret, self.plane.cache, [], dst, job.release_holds, self.plane.config
                )
                job.session, job.messages = session, session.messages
            started = time.monotonic()
            while True:
                step_done = self._step_done  # taken first: a step ending meanwhile still wakes us
                if job.prefilled:
                    break
                await self._send(job, session, self._final_sources(job, session))
                await step_done.wait()  # protects an invariant: a block is shipped only once final
            if not job.ends_at_first_token:  # else D needs no more KV
                await self._send(job, session, self._final_sources(job, session))
        except (TransportError, SessionAborted, ValueError) as exc:  # ValueError: a bad Reserved
            await self.fail(job, PEER_FAILED, f"KV transfer failed: {exc}")
            return
        sent_blocks = sum(m.num_blocks for m in job.messages[: job.sent_messages])
        transport, seconds = transport_label(peer.transports), time.monotonic() - started
        self.metrics.transfer_bytes.labels("send", transport).inc(sent_blocks * self.plane.block_bytes)
        self.metrics.transfer_seconds.labels("send", transport).observe(seconds)
        job.log.info("kv sent", blocks=sent_blocks, seconds=round(seconds, 6), transport=transport)
        assert job.token is not None and job.sampled_at is not None
        done = control_pb2.KVDone(
            rid=job.rid,
            generation=job.generation,
            token_id=job.token,
            num_chunks=job.chunks,
            num_tokens=job.num_kv_tokens,
            finish_reason=job.finish,
            kv_transfer_ms=(time.monotonic() - job.sampled_at) * 1e3,
        )
        if not await self.to_peer(job.decode, kv_done=done):
            await self.fail(job, PEER_FAILED, "decode worker not reading")
            return
        self.rearm_lease(job, "no KVAck within the lease")

    def _final_sources(self, job: PrefillJob, session: SourceSession) -> int:
        """Hand the session every block that is final now (each held by the session until it ends);
        returns how many logical blocks it has."""
        have, final = len(session.block_ids), job.final_blocks(self.block_size)
        if final > have:
            new = job.src_blocks(self.block_size)[have:final]
            job.holds.append(self.plane.hold(new))
            session.extend_sources(new)
        return len(session.block_ids)

    async def _send(self, job: PrefillJob, session: SourceSession, upto: int) -> None:
        """Announce, then send, every message below logical block `upto` (returns once delivered).
        Pull: announce the chunk's source blocks (and, first, the pool) for D to read; nothing to send."""
        if session.state is not SessionState.ACTIVE:  # a pull session learns of no send failing
            raise SessionAborted(session.abort_reason or "aborted")
        chunk = job.next_chunk(self.block_size, upto)
        if chunk is None:
            return
        if isinstance(session, PullSendSession):
            src = session.block_ids[chunk.first_block : chunk.first_block + chunk.num_blocks]
            chunk.src_block_ids = wire.pack_ids(src)
            if chunk.chunk_index == 0:
                chunk.pool.CopyFrom(self.plane.pool_source())
        if not await self.to_peer(job.decode, kv_chunk_ready=chunk):
            raise TransportError("decode worker not reading its control socket")
        self.metrics.transfer_chunks.labels("send", transport_label(session.peer.transports)).inc()
        if isinstance(session, SendSession):
            await session.send(upto)  # waits for delivery; an abort ends it with SessionAborted

    def _stop_shipping(self, job: PrefillJob, outcome: str) -> None:
        if job.shipping is not None and job.shipping is not asyncio.current_task():
            job.shipping.cancel()
        if job.session is not None:
            if outcome == "shipped":
                job.session.acknowledged()  # releases the session's references on the sent blocks
            else:
                job.session.abort(outcome)  # releases them once no send can still read them

    # --- ending -------------------------------------------------------------------------------------

    def _take_early(self, rid: int, generation: int, sender: str) -> control_pb2.Reserved | None:
        """Remove and return the kept Reserved of (rid, generation) from `sender`, if there is one."""
        early = self._early.get(rid)
        if early is None or early[0] != sender or early[1].generation != generation:
            return None
        del self._early[rid]
        early[2].cancel()
        return early[1]

    def _stash(self, sender: str, r: control_pb2.Reserved) -> None:
        old = self._early.pop(r.rid, None)
        if old is not None:
            old[2].cancel()
        lease_s = (r.lease_ms or self.settings.lease_ms) / 1e3
        timer = asyncio.get_running_loop().call_later(lease_s, self._early.pop, r.rid, None)
        self._early[r.rid] = (sender, r, timer)

    def _release(self, rec: WorkerRequest, outcome: str) -> None:
        assert isinstance(rec, PrefillJob)
        self._stop_shipping(rec, outcome)
        self.stepper.release(rec.seq)  # freed, or kept findable by the prefix cache

    def peer_needs_abort(self, rec: WorkerRequest) -> bool:
        return isinstance(rec, PrefillJob) and rec.reserved is not None

    def queue_depths(self) -> dict[str, int]:
        jobs = [j for j in self.records.values() if isinstance(j, PrefillJob)]
        held = sum(1 for j in jobs if j.prefilled and j.reserved is None)
        shipping = sum(1 for j in jobs if j.reserved is not None)
        early = len(self._early)  # Reserved kept for a Prefill (or Reassign) still to come
        return super().queue_depths() | {"held": held, "transferring": shipping, "early_reserved": early}
