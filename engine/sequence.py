"""A request as the engine sees it: token ids, progress, KV blocks, sampling state."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RESERVED = "reserved"  # blocks held for KV that a peer sends; joins the batch with its first token
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled by the caller


@dataclass(slots=True, eq=False)
class Sequence:
    """Created by whoever admits the request to an engine; changed only by that engine's scheduler.

    `token_ids` is prompt + output so far. `num_computed_tokens` counts tokens whose KV is in
    `block_table`'s blocks; the scheduler computes `num_uncomputed_tokens` more before the next
    sample. A preempted sequence drops its blocks and resets `num_computed_tokens` to 0, so it
    resumes by re-prefilling prompt + emitted tokens. `block_table` is append-only while held.
    """

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    num_prompt_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    generator: torch.Generator | None = None
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)
        if self.num_prompt_tokens < 1:
            raise ValueError("a sequence needs at least one prompt token")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose KV is not yet computed: the rest of the prompt, or 1 while decoding."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
