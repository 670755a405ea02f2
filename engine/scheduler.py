"""Continuous-batching scheduler with chunked prefill under one token budget.

Every running sequence needs `num_tokens - num_computed_tokens` tokens computed before its next
sample: a prompt (possibly in chunks), a re-prefill after preemption, or the single newest token in
decode. One step serves running sequences first (oldest first), then admits waiting ones while the
token budget and the KV pool allow. When the pool is short, the newest running sequence is
preempted: its blocks are freed and it returns to the front of the queue to be re-prefilled.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.kv_manager import KVCacheManager
from engine.sequence import FinishReason, Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the sequence, so its last token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSequence]
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Owns the waiting queue and running list of one engine; single-threaded (the step loop)."""

    def __init__(
        self,
        config: EngineConfig,
        kv: KVCacheManager,
        eos_token_ids: tuple[int, ...],
        *,
        keep_blocks_on_finish: bool = False,
        prefill_only: bool = False,
    ) -> None:
        """With `keep_blocks_on_finish`, a sequence that finishes normally keeps its block table: the
        caller (the prefill worker, which still has to ship the KV) frees it with `kv.free(seq)`.
        Aborted and preempted sequences always release at once. With `prefill_only` (the prefill
        worker), a sequence finishes after its first sample: `finish_reason` is its stop reason, or
        None when decoding goes on elsewhere."""
        self.keep_blocks_on_finish = keep_blocks_on_finish
        self.prefill_only = prefill_only
        self.config = config
        self.kv = kv
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = config.max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Join a sequence whose KV is already in its blocks (the decode worker after a transfer)."""
        assert seq.num_computed_tokens <= len(seq.block_table) * self.kv.block_size
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self.kv.cache_computed_blocks(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> Sequence | None:
        """Finish a sequence wherever it is and free its blocks; None if the engine does not hold it."""
        for queue in (self.running, self.waiting):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self._finish(seq, FinishReason.ABORT)
                    return seq
        return None

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted: list[Sequence] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.kv.allocate_slots(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                scheduled.append(ScheduledSequence(seq, n))
                budget -= n
                i += 1
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not preempted:
            seq = self.waiting[0]
            if seq.num_computed_tokens == 0:
                self.kv.match_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.kv.allocate_slots(seq, n):
                self._reset(seq)
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSequence(seq, n))
            budget -= n
        return SchedulerOutput(scheduled, preempted)

    def update(self, out: SchedulerOutput, sampled: dict[Sequence, tuple[int, float]]) -> list[Sequence]:
        """Advance computed counts, append sampled tokens, finish what stops; returns finished ones."""
        finished = []
        for item in out.scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            self.kv.cache_computed_blocks(seq)
            if seq not in sampled:
                continue
            token, logprob = sampled[seq]
            seq.token_ids.append(token)
            seq.output_logprobs.append(logprob)
            reason = self.stop_reason(seq)
            if reason is not None or self.prefill_only:
                self.running.remove(seq)
                self._finish(seq, reason, release=not self.keep_blocks_on_finish)
                finished.append(seq)
        return finished

    def stop_reason(self, seq: Sequence) -> FinishReason | None:
        """Why `seq` stops after its newest token (EOS, stop id, max_tokens, context), or None."""
        params, last = seq.params, seq.token_ids[-1]
        if seq.num_output_tokens >= params.min_tokens and (
            (not params.ignore_eos and last in self.eos_token_ids) or last in params.stop_token_ids
        ):
            return FinishReason.STOP
        if seq.num_output_tokens >= params.max_tokens:
            return FinishReason.LENGTH
        if self.max_model_len is not None and seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _preempt(self, seq: Sequence) -> None:
        self._reset(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _reset(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.num_computed_tokens = 0

    def _finish(self, seq: Sequence, reason: FinishReason | None, *, release: bool = True) -> None:
        if release:
            self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
