"""Stream steps -> OpenAI response objects: chat.completion(.chunk) and text_completion.

One `Renderer` per request, created and used by its route handler only. Streaming: `start()` (the
assistant role chunk, chat only), `chunks(step)` per step, `usage_chunk()` last when the client asked
for usage; non-streaming: `add(step)` per step, then `whole()`. Finish reasons follow docs/api.md:
EOS, stop token and stop string -> "stop", LENGTH -> "length", ABORTED -> "abort"; the matched stop
string or token id is in `stop_reason` (as vLLM does).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from coordinator.chat import TokenizerThread
from coordinator.output import StreamStep
from splitserve.v1 import serving_pb2

FINISH_REASONS = {
    serving_pb2.FINISH_REASON_EOS_TOKEN: "stop",
    serving_pb2.FINISH_REASON_STOP_TOKEN: "stop",
    serving_pb2.FINISH_REASON_STOP_STRING: "stop",
    serving_pb2.FINISH_REASON_LENGTH: "length",
    serving_pb2.FINISH_REASON_ABORTED: "abort",
}
Json = dict[str, Any]


def usage_json(usage: serving_pb2.Usage) -> Json:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
    }


class Renderer:
    """The OpenAI view of one request's output (`chat` or a text completion)."""

    def __init__(
        self,
        *,
        chat: bool,
        request_id: str,
        model: str,
        tokenizer: TokenizerThread,
        logprobs: bool,
        include_usage: bool = False,
    ) -> None:
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.model = model
        self.created = int(time.time())
        self.tokenizer = tokenizer
        self.logprobs = logprobs
        self.include_usage = include_usage
        self.text: list[str] = []
        self.logprob_parts: list[Json] = []
        self.finished: serving_pb2.Finished | None = None
        self._text_offset = 0

    # -- streaming -----------------------------------------------------------------------------------
    def start(self) -> list[Json]:
        """Chunks sent before any output: the assistant role (chat only)."""
        return [self._chunk({"role": "assistant", "content": ""}, None, None)] if self.chat else []

    async def chunks(self, step: StreamStep) -> list[Json]:
        out = []
        if step.delta is not None and (step.delta.text or (self.logprobs and step.delta.logprobs)):
            logprobs = await self._logprobs(step.delta) if self.logprobs else None
            out.append(self._chunk({"content": step.delta.text}, logprobs, None, text=step.delta.text))
        if step.finished is not None:
            self.finished = step.finished
            out.append(self._chunk({}, None, step.finished, text=""))
        return out

    def usage_chunk(self) -> Json:
        assert self.finished is not None
        return self._envelope([], usage=usage_json(self.finished.usage))

    # -- whole response ------------------------------------------------------------------------------
    async def add(self, step: StreamStep) -> None:
        if step.delta is not None:
            self.text.append(step.delta.text)
            if self.logprobs:
                self.logprob_parts.append(await self._logprobs(step.delta))
        if step.finished is not None:
            self.finished = step.finished

    def whole(self) -> Json:
        assert self.finished is not None
        text = "".join(self.text)
        choice = self._choice(self.finished)
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = _merge(self.logprob_parts) if self.logprobs else None
        body = self._envelope([choice], usage=usage_json(self.finished.usage))
        body["object"] = "chat.completion" if self.chat else "text_completion"
        return body

    # -- parts ---------------------------------------------------------------------------------------
    def _envelope(self, choices: list[Json], **extra: Any) -> Json:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        body = {"id": self.id, "object": kind, "created": self.created, "model": self.model}
        return body | {"choices": choices} | extra

    def _choice(self, finished: serving_pb2.Finished | None) -> Json:
        choice: Json = {"index": 0, "finish_reason": None}
        if finished is not None:
            choice["finish_reason"] = FINISH_REASONS.get(finished.reason, "stop")
            stop = finished.WhichOneof("matched_stop")
            choice["stop_reason"] = getattr(finished, stop) if stop else None
        return choice

    def _chunk(
        self, delta: Json, logprobs: Json | None, finished: serving_pb2.Finished | None, text: str = ""
    ) -> Json:
        choice = self._choice(finished) | {"logprobs": logprobs}
        if self.chat:
            choice["delta"] = delta
        else:
            choice["text"] = text
        extra = {"usage": None} if self.include_usage else {}
        return self._envelope([choice], **extra)

    async def _logprobs(self, delta: serving_pb2.Delta) -> Json:
        ids = [i for e in delta.logprobs for i in (e.token_id, *(t.token_id for t in e.top))]
        texts = dict(zip(ids, await self.tokenizer.decode_each(ids), strict=True))
        if self.chat:
            return {"content": [_chat_entry(e, texts) for e in delta.logprobs]}
        tokens = [texts[e.token_id] for e in delta.logprobs]
        offsets = []
        for token in tokens:
            offsets.append(self._text_offset)
            self._text_offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in delta.logprobs],
            "top_logprobs": [{texts[t.token_id]: t.logprob for t in e.top} for e in delta.logprobs],
            "text_offset": offsets,
        }


def _chat_entry(entry: serving_pb2.TokenLogprob, texts: dict[int, str]) -> Json:
    def one(token_id: int, logprob: float) -> Json:
        text = texts[token_id]
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return one(entry.token_id, entry.logprob) | {
        "top_logprobs": [one(t.token_id, t.logprob) for t in entry.top]
    }


def _merge(parts: Sequence[Json]) -> Json:
    """Concatenate per-delta logprobs objects (lists field by field)."""
    merged: Json = {}
    for part in parts:
        for key, values in part.items():
            merged.setdefault(key, []).extend(values)
    return merged
