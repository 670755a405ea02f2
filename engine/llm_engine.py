"""The colocated engine: one process owns the weights, the KV pool, the scheduler and the runner."""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import torch

from engine.block_pool import BlockPool
from engine.config import EngineConfig, long_prompt
from engine.kv_manager import KVCacheManager, cdiv
from engine.loader import LoadedModel, load_model
from engine.model import CausalLM
from engine.runner import ModelRunner, StepResult
from engine.sampler import make_generator
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import FinishReason, Sequence
from engine.step_cost import EMA_WEIGHT, StepCost, ema

log = structlog.get_logger(__name__)

_COLD_STEPS = 2  # a worker's first steps run cold (allocator, thread pool, caches): no cost from them


@dataclass(slots=True)
class StepOutput:
    """What one step produced for one request: its new token (if any) and whether it finished."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    finished: bool
    finish_reason: FinishReason | None
    num_cached_tokens: int


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    tokens_computed: int = 0
    preemptions: int = 0
    extra: dict[str, int] = field(default_factory=dict)


def kv_block_bytes(model: CausalLM, block_size: int) -> int:
    cfg = model.config
    itemsize = model.embed.element_size()
    return cfg.num_hidden_layers * 2 * block_size * cfg.num_key_value_heads * cfg.head_dim * itemsize


class LLMEngine:
    """Single-threaded step loop over a colocated prefill+decode engine.

    `add_request` validates and queues; `step` runs one scheduler step and returns per-request
    outputs. Finished and aborted requests have already released every KV block when they are
    reported, unless `config.keep_blocks_on_finish` keeps a finished one's blocks for `release`.
    This class is the one door into the engine's state for the workers: sequences enter by
    `add_request` (prefilled here) or `reserve` + `join` (KV computed elsewhere) and leave by
    finishing or by `release`; the scheduler, KV manager and pool change only through it.
    """

    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.loaded = loaded
        self.config = config
        self.device = torch.device(config.device)
        model_cfg = loaded.config
        self.model = CausalLM(model_cfg, loaded.weights)
        self.max_model_len = min(
            config.max_model_len or model_cfg.max_position_embeddings, model_cfg.max_position_embeddings
        )
        config.max_model_len = self.max_model_len
        num_blocks = config.num_blocks or max(
            1, config.kv_cache_memory_bytes // kv_block_bytes(self.model, config.block_size)
        )
        self.pool = BlockPool(num_blocks, config.block_size)
        self.kv = KVCacheManager(self.pool, loaded.identity, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv, model_cfg.eos_token_ids)
        self.runner = ModelRunner(self.model, self.kv, num_blocks, model_cfg.eos_token_ids, self.device)
        self.stats = EngineStats()
        self._requests: dict[str, Sequence] = {}
        # step costs, from every timed step (`_observe_cost`)
        self.step_cost = StepCost(EMA_WEIGHT, cold_steps=0)  # all tokens -> step ms: the router's fit
        self.decode_step_ms = 0.0  # a step without prompt work, moving average
        self._prompt_cost = StepCost(EMA_WEIGHT, cold_steps=0)  # prompt tokens -> the ms they add
        # the same over steps run on borrowed cores (engine/worker/core_lease.py), kept apart
        self.borrowed_prompt_cost = StepCost(EMA_WEIGHT, cold_steps=0)
        self._cold_steps = _COLD_STEPS
        log.info(
            "engine ready",
            model=str(loaded.model_dir),
            identity=loaded.identity[:12],
            num_blocks=num_blocks,
            block_size=config.block_size,
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, config: EngineConfig | None = None) -> LLMEngine:
        config = config or EngineConfig()
        return cls(load_model(model_dir, dtype=config.torch_dtype, device=config.device), config)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming the limit when the request can never run on this engine."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty: send at least one token")
        vocab = self.loaded.config.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
                f"length {self.max_model_len}; shorten the prompt or lower max_tokens"
            )
        if cdiv(n + params.max_tokens, self.pool.block_size) > self.pool.num_blocks:
            raise ValueError(
                f"prompt + max_tokens needs more KV blocks than this engine has ({self.pool.num_blocks})"
            )

    def new_sequence(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_token_ids: Seq[int] = (),
    ) -> Sequence:
        """Validate and build a sequence without queueing it (the caller queues it or joins it running).

        `output_token_ids` are tokens already emitted (a resumed request): the sequence is prompt +
        output, and its next sample is output position `len(output_token_ids)`.
        """
        self.validate(prompt_token_ids, params)
        seq = Sequence(
            request_id,
            [*prompt_token_ids, *output_token_ids],
            params,
            num_prompt_tokens=len(prompt_token_ids),
        )
        if params.seed is not None:
            seq.generator = make_generator(params.seed, self.device)
        return seq

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_token_ids: Seq[int] = (),
    ) -> Sequence:
        self._check_new(request_id)
        seq = self.new_sequence(request_id, prompt_token_ids, params, output_token_ids)
        self._requests[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def reserve(self, seq: Sequence) -> list[int] | None:
        """Hold KV blocks for all of `seq` (from `new_sequence`), whose KV another worker computes: own
        prefix-cache hits first (`seq.num_cached_tokens` tokens), fresh blocks for the rest. Returns
        the fresh block ids, or None when the pool is short (nothing changed, nothing held). From here
        the engine owns `seq` until `release`; `join` starts its decode once the KV has landed."""
        self._check_new(seq.request_id)
        ids = self.scheduler.reserve(seq)
        if ids is not None:
            self._requests[seq.request_id] = seq
        return ids

    def join(self, seq: Sequence, token_id: int) -> None:
        """Start decoding a reserved `seq` whose KV is in its blocks, from its first token `token_id`
        (sampled where the prompt was prefilled)."""
        if self._requests.get(seq.request_id) is not seq:
            raise ValueError(f"request {seq.request_id!r} is not reserved on this engine")
        self.scheduler.join(seq, token_id)

    def release(self, seq: Sequence) -> bool:
        """Take `seq` out of the engine wherever it is and drop every block reference it holds, exactly
        once. False (nothing done) when the engine no longer holds it, e.g. a second call."""
        if self._requests.get(seq.request_id) is not seq:
            return False
        del self._requests[seq.request_id]
        self.scheduler.release(seq)
        return True

    def _check_new(self, request_id: str) -> None:
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in flight")

    def abort_request(self, request_id: str) -> bool:
        seq = self._requests.get(request_id)
        return seq is not None and self.release(seq)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def _observe_cost(self, out: SchedulerOutput, ms: float, widened: bool) -> None:
        """The step costs the engine keeps: `step_cost`, the fit over every step's tokens the router
        prices prompts by (its workers report it); `decode_step_ms`, a moving average of steps without
        prompt work; and the scheduler's `prompt_cost` (its `prefill_ms_while_decoding` cap), what the
        prompt tokens of the other steps added beyond that, fitted as fixed + tokens x per-token
        (`StepCost`: the first prompt tokens of a step cost a few ms more than later ones, and an
        average per token would charge that to every token, shrinking the cap step by step to one
        token). A `widened` step (run on borrowed cores beside this worker's own) feeds only
        `borrowed_prompt_cost`, the same prompt fit, so the home fits (and the time cap they size)
        keep what this worker's own cores do. The first `_COLD_STEPS` are left out."""
        if self._cold_steps > 0:
            self._cold_steps -= 1
            return
        prompt = sum(item.num_new_tokens for item in out.scheduled if item.is_prompt_chunk)
        if widened:
            if prompt and self.decode_step_ms > 0:
                self.borrowed_prompt_cost.observe(prompt, ms - self.decode_step_ms)
            return
        self.step_cost.observe(out.num_tokens, ms)
        if not prompt:
            self.decode_step_ms = ema(self.decode_step_ms, ms)
        elif self.decode_step_ms > 0:
            self._prompt_cost.observe(prompt, ms - self.decode_step_ms)
            self.scheduler.prompt_cost = (self._prompt_cost.base_ms, self._prompt_cost.us_per_token / 1e3)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def _widened_prompt_cost(self) -> tuple[float, float] | None:
        """`borrowed_prompt_cost` as the scheduler's (fixed ms, ms a token); None until measured (a
        step on borrowed cores is then capped at the home cost)."""
        cost = self.borrowed_prompt_cost
        return (cost.base_ms, cost.us_per_token / 1e3) if cost.us_per_token > 0 else None

    def prompt_tokens_while_decoding_widened(self) -> int:
        """The scheduler's cap on prompt tokens beside decodes in a step on borrowed cores (priced by
        `borrowed_prompt_cost`; the home cap until that is measured)."""
        return self.scheduler.prompt_tokens_while_decoding(self._widened_prompt_cost())

    def short_prompt_pending(self) -> bool:
        """Whether a prompt of at most `long_prefill_token_threshold` tokens waits or is mid-prefill."""
        threshold = self.config.long_prefill_token_threshold
        sched = self.scheduler
        return any(not long_prompt(threshold, s.num_prompt_tokens) for s in sched.waiting) or any(
            s.num_uncomputed_tokens > 1 and not long_prompt(threshold, s.num_prompt_tokens)
            for s in sched.running
        )

    def step(self) -> list[StepOutput]:
        out = self.schedule()
        if not out.scheduled:
            return []
        start = time.perf_counter()
        result = self.execute(out)
        return self.finish_step(out, result, time.perf_counter() - start)

    def schedule(self, widened: bool = False) -> SchedulerOutput:
        """First part of `step`, on the thread that owns the engine: pick the step's work and allocate
        its slots (this may preempt). `widened`: the step runs on borrowed cores too, and the time cap
        prices its prompt tokens by their fit there (`borrowed_prompt_cost`, once measured)."""
        out = self.scheduler.schedule(self._widened_prompt_cost() if widened else None)
        self.stats.preemptions += len(out.preempted)
        return out

    def execute(self, out: SchedulerOutput) -> StepResult:
        """The forward and sampling of a scheduled step. It reads only the runner and the scheduled
        sequences, so it may run on another thread while the owner handles messages, provided the
        owner neither frees nor changes those sequences before `finish_step`."""
        return self.runner.execute(out)

    def finish_step(
        self, out: SchedulerOutput, result: StepResult, seconds: float | None = None, widened: bool = False
    ) -> list[StepOutput]:
        """Last part of `step`, on the owning thread: advance the sequences and report their outputs.
        `seconds` (the step's `execute` time; None: not timed) feeds the step costs; `widened`: the
        step ran on borrowed cores too."""
        if seconds is not None:
            self._observe_cost(out, seconds * 1e3, widened)
        finished = set(self.scheduler.update(out, result.sampled))
        self.stats.steps += 1
        self.stats.tokens_computed += out.num_tokens
        outputs = []
        for seq, (token, logprob) in result.sampled.items():
            done = seq in finished
            if done and not seq.block_table:  # else held until `release` (keep_blocks_on_finish)
                del self._requests[seq.request_id]
            outputs.append(
                StepOutput(
                    seq.request_id,
                    [token],
                    [logprob],
                    [result.top_logprobs.get(seq, [])],
                    done,
                    seq.finish_reason,
                    seq.num_cached_tokens,
                )
            )
        if self.config.debug_integrity:
            self.pool.check_integrity()
        return outputs
