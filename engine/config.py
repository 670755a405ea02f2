"""Engine settings shared by the colocated engine, the prefill worker and the decode worker."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "bfloat16", "float16")  # torch dtype names; torch loads only for `torch_dtype`


def prefill_budget(step_budget: int, cap: int, decodes: int) -> int:
    """Prompt tokens one step may carry beside `decodes` running decodes: the step budget they leave,
    at most `cap` (`EngineConfig.prefill_tokens_while_decoding`, 0: off) while any decode runs. The
    scheduler applies it; the router projects a decode worker's local prefill with it."""
    spare = step_budget - decodes
    return min(spare, cap) if cap and decodes else spare


def long_prompt(threshold: int, tokens_left: int) -> bool:
    """More prompt tokens left than `EngineConfig.long_prefill_token_threshold` (never while it is
    0): the scheduler runs one such prompt at a time, workers report their tokens apart
    (`WorkerLoad.queued_long_tokens`), and the router prices them behind each other."""
    return 0 < threshold < tokens_left


@dataclass(slots=True)
class EngineConfig:
    """How one engine instance sizes its KV pool and its steps.

    `num_blocks` fixes the KV pool size; when None it is derived from `kv_cache_memory_bytes`.
    `max_num_batched_tokens` is the per-step token budget that chunked prefill and decode share.
    `prefill_tokens_while_decoding` (0: off) caps the prompt tokens of a step that also carries a
    running decode, so a prompt prefilled beside decodes (a decode worker's local prefill) adds at
    most that many tokens of compute to their inter-token latency; a step with no decode uses the
    whole budget. `prefill_ms_while_decoding` (0: off) caps them by time instead (or as well: the
    lower cap wins): as many prompt tokens as that many milliseconds buy at the engine's measured
    cost of a prompt token beside decodes (`Scheduler.prompt_tokens_while_decoding`), so the bound
    on a running request's step holds on a host whose prompt tokens cost twice another's.
    `long_prefill_token_threshold` (0: off; vLLM's flag of that name, with its default of one long
    partial prefill) caps the chunk any one prompt takes of a step and lets one prompt with more
    tokens left than that run at a time (the oldest); shorter prompts go before its chunk, which
    fills the step's prompt tokens up to the threshold after them (at least one KV block, so it
    always advances): a 64-token prompt behind a 1,024-token one then waits one step, not the whole
    prompt, in a step no longer than the long prompt's alone, and long prompts still finish one after
    another rather than all late. `short_prompts_whole` (needs the threshold) leaves the caps beside
    decodes to long prompts' chunks: a short prompt (at most the threshold) runs whole in the step
    it starts in, so the requests decoding beside it see one gap of its prefill instead of several
    capped ones (at a p99 inter-token bound, fewer gaps over it), and its first token comes a step or
    two sooner; a long prompt's chunks, seconds of them, stay capped.

    Role policy (set by the role that builds the engine, never changed after construction):
    `prefill_only` finishes a sequence after its first sample (its `finish_reason` is its stop reason,
    or None when decoding goes on elsewhere); `keep_blocks_on_finish` keeps a normally finished
    sequence's blocks until the owner calls `LLMEngine.release` (the prefill worker still ships them).
    Aborted and preempted sequences always release at once.
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_bytes: int = 256 << 20
    max_num_batched_tokens: int = 512
    prefill_tokens_while_decoding: int = 0
    prefill_ms_while_decoding: float = 0.0
    long_prefill_token_threshold: int = 0
    short_prompts_whole: bool = False
    max_num_seqs: int = 64
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    dtype: str = "float32"
    device: str = "cpu"
    debug_integrity: bool = False
    prefill_only: bool = False
    keep_blocks_on_finish: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        for name in (
            "prefill_tokens_while_decoding",
            "long_prefill_token_threshold",
            "prefill_ms_while_decoding",
        ):
            if not getattr(self, name) >= 0:  # also refuses NaN
                raise ValueError(f"{name} must be >= 0 (0: off), got {getattr(self, name)}")
        if self.short_prompts_whole and not self.long_prefill_token_threshold:
            raise ValueError(
                "short_prompts_whole needs long_prefill_token_threshold > 0 (what a short prompt is)"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype
