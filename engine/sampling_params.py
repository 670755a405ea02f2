"""Per-request sampling and stopping parameters, as vLLM users know them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

_MAX_STOP_STRINGS = 16
_MAX_STOP_STRING_CHARS = 256


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    Created by the caller (the offline `LLM` API or the coordinator's admission); never mutated
    afterwards. `__post_init__` rejects out-of-range values with a `ValueError` that names the field and
    the accepted range, so the coordinator can turn it into INVALID_ARGUMENT verbatim.

    temperature == 0 means greedy; top_k <= 0 and top_p == 1 and min_p == 0 disable those filters.
    Penalties follow vLLM: repetition multiplies (>1 discourages tokens seen in prompt or output),
    presence/frequency subtract from logits of tokens seen in the output.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        _check_range("temperature", self.temperature, 0.0, 100.0)
        _check_range("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("repetition_penalty", self.repetition_penalty, 0.0, 100.0, low_open=True)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or a positive count, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be between 0 and 20, got {self.logprobs}")
        if len(self.stop) > _MAX_STOP_STRINGS:
            raise ValueError(f"at most {_MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}")
        for s in self.stop:
            if not s or len(s) > _MAX_STOP_STRING_CHARS:
                raise ValueError(
                    f"each stop string must have 1 to {_MAX_STOP_STRING_CHARS} characters, got {len(s)}"
                )
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative token ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check_range(name: str, value: float, low: float, high: float, *, low_open: bool = False) -> None:
    ok = math.isfinite(value) and (low < value if low_open else low <= value) and value <= high
    if not ok:
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be a finite number in {bracket}{low}, {high}], got {value}")
