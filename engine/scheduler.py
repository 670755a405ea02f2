"""Continuous-batching scheduler with chunked prefill under one token budget.

Every running sequence needs its `num_uncomputed_tokens` computed before its next sample: a prompt
(possibly in chunks), a re-prefill after preemption, or the single newest token in decode. One step
serves running sequences first, then admits waiting ones while the token budget and the KV pool
allow. Running decodes (one token each) take the budget before running prompt chunks (each group
oldest first), so a long prompt is prefilled in chunks that fit beside the decodes (Sarathi-Serve's
stall-free batching): a decode never waits for a prompt, and a step computes at most the budget.
With `prefill_tokens_while_decoding` a step that carries decodes schedules at most that many prompt
tokens, so a prefill beside running requests stretches their step by a bounded amount; with
`prefill_ms_while_decoding`, at most the tokens that many milliseconds buy at the measured cost of a
prompt token beside decodes (`prompt_cost`, which the engine updates after every step). Under
`long_prefill_token_threshold` short prompts go before the one long prompt, which keeps one block of
their steps and fills the steps without them up to the threshold (`_LongPromptSlot`); with
`short_prompts_whole` the caps beside decodes bound only long prompts' chunks (by the prefill's whole
length, so a long prompt's tail stays capped), and a short prompt takes what the step budget leaves
(past the cap, the long prompt then waits that step). When the pool is short, the newest running
sequence not yet scheduled this step is preempted: its blocks are freed and it returns to the front
of the queue to be re-prefilled.

A sequence whose KV another worker computes takes a third way in: `reserve` (all or nothing) holds
blocks for it, `join` puts it in the running list once the KV has landed, with its first token as
the next input. `release` takes any sequence out, wherever it is, and frees its blocks exactly once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from engine.config import EngineConfig, long_prompt, prefill_budget
from engine.kv_manager import KVCacheManager
from engine.sequence import FinishReason, Sequence, SequenceStatus


@dataclass(slots=True)
class _LongPromptSlot:
    """One step's single place for a long prompt, and what it leaves the short ones.

    Under `long_prefill_token_threshold` (0: off) only the first prompt asked about with more tokens
    left than the threshold gets the slot (the scheduler asks oldest first); shorter prompts always
    pass, and go first. In a step that carries short prompts (`short_scheduled`, or `short_waiting`
    to be admitted after the running ones) the long prompt takes only `floor` (one KV block), so it
    advances every step however many short prompts arrive while their step stays as short as they
    are: the long prompt's tokens are computed all the same, a step later, and the short prompts'
    first tokens come at once instead of after a threshold's worth of its chunk. It takes at most half
    the prompt tokens the step has left, so that under a cap of a block or less (a decode worker's
    time cap beside its decodes) a waiting short prompt still starts. A step without short prompts
    gives it up to the threshold."""

    threshold: int
    floor: int
    short_waiting: set[Sequence]  # waiting short prompts, not yet admitted this step
    short_scheduled: int = 0
    taken: bool = False

    @classmethod
    def for_step(cls, threshold: int, floor: int, waiting: Iterable[Sequence]) -> _LongPromptSlot:
        short = (
            {s for s in waiting if not long_prompt(threshold, s.num_uncomputed_tokens)}
            if threshold
            else set()
        )
        return cls(threshold, floor, short)

    def _is_long(self, seq: Sequence) -> bool:
        return long_prompt(self.threshold, seq.num_uncomputed_tokens)

    def admits(self, seq: Sequence) -> bool:
        if not self._is_long(seq):
            return True
        if self.taken:
            return False
        self.taken = True
        return True

    def share(self, seq: Sequence, prefill: int) -> int:
        """Prompt tokens `seq` may take of the `prefill` left this step."""
        if not self._is_long(seq):
            return prefill
        if self.short_scheduled or self.short_waiting:
            return min(self.floor, prefill // 2)  # a short prompt's step stays short; both advance
        return prefill

    def scheduled(self, seq: Sequence, tokens: int) -> None:
        """`seq` takes `tokens` of this step's prompt tokens."""
        self.short_waiting.discard(seq)
        if not self._is_long(seq):
            self.short_scheduled += tokens

    def order(self, seq: Sequence) -> int:
        """Running work in step order: decodes, then short prompt chunks, then the long prompt's."""
        left = seq.num_uncomputed_tokens
        return 0 if left == 1 else 2 if long_prompt(self.threshold, left) else 1


@dataclass(slots=True)
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int

    @property
    def is_prompt_chunk(self) -> bool:
        """Prompt work (a prompt's chunk, or a re-prefill's), not a running sequence's one decode
        token. Unlike the budget split in `schedule` (which counts any one-token remainder with the
        decodes), a prompt's last single token is prompt work here: under a one-token time cap every
        prompt step is such a token, and the step-cost fit must still see it."""
        return self.num_new_tokens > 1 or self.seq.num_computed_tokens < self.seq.num_prompt_tokens

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

    def __init__(self, config: EngineConfig, kv: KVCacheManager, eos_token_ids: tuple[int, ...]) -> None:
        """Role policy comes from `config` (`prefill_only`, `keep_blocks_on_finish`)."""
        self.config = config
        self.kv = kv
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = config.max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # what prompt tokens add to a step carrying decodes, measured: (fixed ms, ms a token);
        # LLMEngine's step accounting writes it; a slope of 0: not yet measured, no time cap
        self.prompt_cost = (0.0, 0.0)

    def prompt_tokens_while_decoding(self, prompt_cost: tuple[float, float] | None = None) -> int:
        """The cap on a step's prompt tokens beside running decodes (0: none): the token cap, and the
        time cap in tokens at the measured cost, `(ms - fixed) / per_token` (at least one token, so a
        prompt always advances; none until a cost is measured). What the scheduler applies and the
        worker reports; `prompt_cost` (fixed ms, ms a token): at that cost instead of `prompt_cost`'s."""
        cap = self.config.prefill_tokens_while_decoding
        ms = self.config.prefill_ms_while_decoding
        fixed, per_token = self.prompt_cost if prompt_cost is None else prompt_cost
        if ms > 0 and per_token > 0:
            by_time = max(1, int((ms - fixed) / per_token))
            cap = min(cap, by_time) if cap else by_time
        return cap

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def reserve(self, seq: Sequence) -> list[int] | None:
        """Hold blocks for all of a fresh sequence's KV, all or nothing (`KVCacheManager.reserve`):
        the fresh ids, or None with nothing changed."""
        ids = self.kv.reserve(seq)
        if ids is not None:
            seq.status = SequenceStatus.RESERVED
        return ids

    def join(self, seq: Sequence, token_id: int) -> None:
        """A reserved sequence's KV has landed in its blocks: it runs, with `token_id` (sampled by the
        peer, never recomputed) as its next input."""
        if seq.status is not SequenceStatus.RESERVED:
            raise ValueError(f"{seq.request_id} is {seq.status.value}, not reserved: it cannot join")
        assert seq.num_tokens <= len(seq.block_table) * self.kv.block_size
        seq.num_computed_tokens = seq.num_tokens
        seq.token_ids.append(token_id)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self.kv.cache_computed_blocks(seq)

    def prompt_tokens_left(self) -> list[int]:
        """Each queued or running prompt's tokens still to compute (a running decode's one token is
        not prompt work): what the worker reports as its queue and the router counts."""
        running = (s.num_uncomputed_tokens for s in self.running)
        return [s.num_uncomputed_tokens for s in self.waiting] + [n for n in running if n > 1]

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def release(self, seq: Sequence) -> None:
        """Take `seq` out wherever it is (queued, reserved, running, finished with its blocks kept) and
        drop its block references; an unfinished one finishes as aborted. A second call is a no-op."""
        if seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.RUNNING and seq in self.running:
            self.running.remove(seq)
        if seq.is_finished:
            self.kv.free(seq)
        else:
            self._finish(seq, FinishReason.ABORT)

    def schedule(self, prompt_cost: tuple[float, float] | None = None) -> SchedulerOutput:
        """One step's work; `prompt_cost` prices the time cap's prompt tokens in place of
        `self.prompt_cost` (a step on borrowed cores: `LLMEngine.schedule(widened=True)`)."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted: list[Sequence] = []
        taken: set[Sequence] = set()
        decodes = sum(1 for s in self.running if s.num_uncomputed_tokens == 1)
        prefill = prefill_budget(
            budget, self.prompt_tokens_while_decoding(prompt_cost), decodes
        )  # prompt tokens left this step
        whole = prefill_budget(budget, 0, decodes)  # past the caps: short_prompts_whole's prompts
        threshold = self.config.long_prefill_token_threshold

        def room(seq: Sequence) -> int:
            """Prompt tokens `seq` may take of what is left this step."""
            if self.config.short_prompts_whole and not long_prompt(threshold, seq.num_tokens):
                return whole
            return prefill

        chunk = threshold or budget  # one prompt's share of a step
        # under the threshold, one long prompt (more than `chunk` tokens left) at a time, oldest
        # first: long prompts finish in turn instead of sharing steps, and short ones go before the
        # long one, which keeps a block of their steps
        long_slot = _LongPromptSlot.for_step(threshold, min(self.kv.block_size, chunk), self.waiting)
        # decodes first, then prompt chunks (short ones, then the long one; each oldest first): a
        # prefill only gets the budget the running decodes leave (and, beside decodes, at most
        # prompt_tokens_while_decoding()), so it never delays their next token by more than that
        for seq in sorted(self.running, key=long_slot.order):
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted below for an earlier sequence's slots
            n = min(seq.num_uncomputed_tokens, budget)
            if n > 1:  # a prompt chunk
                if not long_slot.admits(seq):
                    continue
                n = min(n, long_slot.share(seq, room(seq)), chunk)
                if n <= 0:
                    break  # prompt chunks come last: the prefill budget is spent
                prefill, whole = prefill - n, whole - n
                long_slot.scheduled(seq, n)
            while not self.kv.allocate_slots(seq, n):
                victim = next(s for s in reversed(self.running) if s not in taken)
                self.running.remove(victim)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                scheduled.append(ScheduledSequence(seq, n))
                taken.add(seq)
                budget -= n
        for seq in list(self.waiting):
            if (
                min(budget, max(prefill, whole)) <= 0
                or len(self.running) >= self.config.max_num_seqs
                or preempted
            ):
                break
            if not long_slot.admits(seq):
                continue  # a shorter prompt behind it may still start
            if seq.num_computed_tokens == 0:
                self.kv.match_prefix(seq)
            n = min(seq.num_uncomputed_tokens, budget, long_slot.share(seq, room(seq)), chunk)
            if n <= 0:  # a long prompt whose half of the step's last prompt token is none
                self._reset(seq)
                continue
            if not self.kv.allocate_slots(seq, n):
                self._reset(seq)
                break
            prefill, whole = prefill - n, whole - n
            long_slot.scheduled(seq, n)
            self.waiting.remove(seq)
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
            if reason is not None or self.config.prefill_only:
                self.running.remove(seq)
                self._finish(seq, reason, release=not self.config.keep_blocks_on_finish)
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
