"""The offline API: `LLM(model_dir).generate(prompts, SamplingParams(...))`, as vLLM users know it."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.sequence import FinishReason

PromptLike = str | list[int]


@dataclass(slots=True)
class RequestOutput:
    """One finished generation: output token ids and text (stop string excluded), finish reason."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | None = None
    logprobs: list[float] = field(default_factory=list)
    num_cached_tokens: int = 0


class LLM:
    """In-process engine over a local Hugging Face checkpoint directory (no servers involved)."""

    def __init__(self, model: str | Path, **engine_kwargs: Any) -> None:
        self.engine = LLMEngine.from_model_dir(model, EngineConfig(**engine_kwargs))
        self.tokenizer = self.engine.loaded.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: PromptLike | Seq[PromptLike],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
        if len(params_list) != len(prompt_list):
            raise ValueError(f"{len(params_list)} sampling params for {len(prompt_list)} prompts")
        outputs: dict[str, RequestOutput] = {}
        detoks: dict[str, IncrementalDetokenizer] = {}
        for prompt, params in zip(prompt_list, params_list, strict=True):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
            rid = str(next(self._ids))
            self.engine.add_request(rid, ids, params)
            outputs[rid] = RequestOutput(rid, prompt if isinstance(prompt, str) else None, ids)
            detoks[rid] = IncrementalDetokenizer(self.tokenizer, ids, stop=params.stop)
        while self.engine.has_unfinished():
            for step in self.engine.step():
                out = outputs[step.request_id]
                delta = detoks[step.request_id].push(step.new_token_ids)
                out.token_ids.extend(delta.token_ids)  # ids past a matched stop string are dropped
                out.logprobs.extend(step.new_logprobs[: len(delta.token_ids)])
                out.num_cached_tokens = step.num_cached_tokens
                out.text += delta.text
                if delta.stopped and not step.finished:
                    self.engine.abort_request(step.request_id)
                if delta.stopped:
                    out.finish_reason, out.stop_reason = FinishReason.STOP.value, delta.matched_stop
                elif step.finished:
                    out.text += detoks[step.request_id].finish()
                    out.finish_reason = step.finish_reason.value if step.finish_reason else None
        return list(outputs.values())


def _as_prompt_list(prompts: PromptLike | Seq[PromptLike]) -> list[PromptLike]:
    """One prompt (text or token ids) or many, as a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [[int(t) for t in items]]  # type: ignore[arg-type]
    return [p if isinstance(p, str) else list(p) for p in items]  # type: ignore[arg-type]
