"""OpenAI request bodies -> the `ChatRequest` / `GenerateRequest` a gRPC client would send.

Only the shape is checked here (types, which fields exist, n=1); every range, the byte size, the chat
template and the token limits are checked afterwards by `coordinator.admission`, exactly as for gRPC.
A shape error is an `RpcError` (INVALID_ARGUMENT) naming the OpenAI parameter. Unknown fields are
ignored (clients send extras); fields that would change the meaning of the answer and that splitserve
does not implement (tools, response_format, logit_bias, echo, suffix, best_of > 1, n > 1) are refused.
The field-by-field mapping is the table in docs/http.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format

from coordinator.errors import invalid
from splitserve.v1 import serving_pb2

# OpenAI's default for /v1/completions; chat uses the server's own default (see admission)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MAX_TOP_LOGPROBS = 20
_UINT32 = (0, 2**32 - 1)
_INT32 = (-(2**31), 2**31 - 1)
_UINT64 = (0, 2**64 - 1)
_UNSUPPORTED = (
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "response_format",
    "logit_bias",
    "audio",
    "modalities",
    "prediction",
    "web_search_options",
    "suffix",
)
_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    """A parsed body: the protobuf request for admission, plus how the answer is shaped."""

    message: serving_pb2.ChatRequest | serving_pb2.GenerateRequest
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    renames: Mapping[str, str] = field(default_factory=dict)  # request path -> OpenAI param for errors


class _Body:
    """Typed getters over a JSON object; each wrong type is a 400 naming the parameter."""

    def __init__(self, body: object) -> None:
        if not isinstance(body, dict):
            raise invalid("body", "the request body must be a JSON object")
        self.data: dict[str, Any] = body

    def has(self, name: str) -> bool:
        return self.data.get(name) is not None

    def boolean(self, name: str) -> bool | None:
        value = self.data.get(name)
        if value is not None and not isinstance(value, bool):
            raise invalid(name, f"{name} must be true or false, got {value!r}")
        return value

    def number(self, name: str) -> float | None:
        value = self.data.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise invalid(name, f"{name} must be a finite number, got {value!r}")
        return float(value)

    def integer(self, name: str, bounds: tuple[int, int]) -> int | None:
        value = self.data.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise invalid(name, f"{name} must be an integer, got {value!r}")
        if not bounds[0] <= value <= bounds[1]:
            raise invalid(name, f"{name} must be in [{bounds[0]}, {bounds[1]}], got {value}")
        return value

    def string(self, name: str) -> str | None:
        value = self.data.get(name)
        if value is not None and not isinstance(value, str):
            raise invalid(name, f"{name} must be a string, got {type(value).__name__}")
        return value

    def strings(self, name: str) -> list[str]:
        """A string or a list of strings (None: empty)."""
        value = self.data.get(name)
        value = [value] if isinstance(value, str) else value
        if value is not None and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise invalid(name, f"{name} must be a string or a list of strings")
        return value or []

    def integers(self, name: str) -> list[int]:
        """A list of token ids (None: empty)."""
        value = self.data.get(name)
        if value is not None and not _is_id_list(value):
            raise invalid(name, f"{name} must be a list of non-negative integers")
        return list(value or [])


def parse_chat(body: object, request_id: str = "") -> OpenAIRequest:
    """`POST /v1/chat/completions`."""
    b = _Body(body)
    logprobs = bool(b.boolean("logprobs"))
    top = b.integer("top_logprobs", (0, MAX_TOP_LOGPROBS))
    if top is not None and not logprobs:
        raise invalid("top_logprobs", "top_logprobs requires logprobs: true")
    output = serving_pb2.OutputOptions(logprobs=top or 0) if logprobs else serving_pb2.OutputOptions()
    template = serving_pb2.ChatTemplateOptions()
    for name in ("add_generation_prompt", "continue_final_message"):
        if (flag := b.boolean(name)) is not None:
            setattr(template, name, flag)
    kwargs = b.data.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise invalid("chat_template_kwargs", "chat_template_kwargs must be a JSON object")
        json_format.ParseDict(kwargs, template.kwargs)
    message = serving_pb2.ChatRequest(
        model=b.string("model") or "",
        request_id=request_id,
        messages=_messages(b.data.get("messages")),
        template=template,
        output=output,
    )
    stream, include_usage = _common(b, message, ("max_completion_tokens", "max_tokens"), None)
    return OpenAIRequest(message, stream, include_usage, logprobs, {"output.logprobs": "top_logprobs"})


def parse_completion(body: object, request_id: str = "") -> OpenAIRequest:
    """`POST /v1/completions`."""
    b = _Body(body)
    if b.boolean("echo"):
        raise invalid("echo", "echo is not supported: the response never repeats the prompt")
    if b.integer("best_of", _UINT32) not in (None, 1):
        raise invalid("best_of", "best_of must be 1 (or unset): one completion per request")
    logprobs = b.integer("logprobs", (0, MAX_TOP_LOGPROBS))
    output = serving_pb2.OutputOptions() if logprobs is None else serving_pb2.OutputOptions(logprobs=logprobs)
    message = serving_pb2.GenerateRequest(model=b.string("model") or "", request_id=request_id, output=output)
    prompt = b.data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and not _is_id_list(prompt):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        message.text = prompt
    elif _is_id_list(prompt):
        message.token_ids.ids.extend(prompt)
    elif isinstance(prompt, list):
        raise invalid("prompt", "batched prompts are not supported: send one prompt per request")
    else:
        raise invalid("prompt", "prompt must be a string or a list of token ids")
    stream, include_usage = _common(b, message, ("max_tokens",), COMPLETIONS_DEFAULT_MAX_TOKENS)
    return OpenAIRequest(
        message, stream, include_usage, logprobs is not None, {"output.logprobs": "logprobs"}
    )


def _common(
    b: _Body,
    message: serving_pb2.ChatRequest | serving_pb2.GenerateRequest,
    max_tokens_names: tuple[str, ...],
    default_max_tokens: int | None,
) -> tuple[bool, bool]:
    """Fill the knobs both routes share; returns (stream, include_usage)."""
    for name in _UNSUPPORTED:
        if b.has(name) and not (name == "tool_choice" and b.data[name] == "none"):
            raise invalid(name, f"{name} is not supported by this server; leave it unset")
    if b.integer("n", _UINT32) not in (None, 1):
        raise invalid("n", "n must be 1 (or unset): send one request per completion")
    sampling, stopping = message.sampling, message.stopping
    for name in _FLOATS:
        if (value := b.number(name)) is not None:
            setattr(sampling, name, value)
    if (top_k := b.integer("top_k", _INT32)) is not None:
        sampling.top_k = top_k
    if (seed := b.integer("seed", _UINT64)) is not None:
        sampling.seed = seed
    max_tokens = next(
        (v for v in (b.integer(n, _UINT32) for n in max_tokens_names) if v is not None), default_max_tokens
    )
    if max_tokens is not None:
        stopping.max_tokens = max_tokens
    if (min_tokens := b.integer("min_tokens", _UINT32)) is not None:
        stopping.min_tokens = min_tokens
    stopping.stop.extend(b.strings("stop"))
    stopping.stop_token_ids.extend(b.integers("stop_token_ids"))
    for name in ("ignore_eos", "include_stop_str_in_output"):
        if (flag := b.boolean(name)) is not None:
            setattr(stopping, name, flag)
    if (skip := b.boolean("skip_special_tokens")) is not None:
        message.output.skip_special_tokens = skip
    if (priority := b.integer("priority", _INT32)) is not None:
        message.priority = priority
    stream = bool(b.boolean("stream"))
    options = b.data.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise invalid("stream_options", "stream_options is only allowed with stream: true")
    if not isinstance(options, dict):
        raise invalid("stream_options", "stream_options must be a JSON object")
    return stream, bool(_Body(options).boolean("include_usage"))


def _messages(raw: object) -> list[serving_pb2.ChatMessage]:
    if raw is None:
        raise invalid("messages", "messages is required: send at least one chat message")
    if not isinstance(raw, list):
        raise invalid("messages", "messages must be a list of {role, content} objects")
    out = []
    for i, item in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(item, dict) or not isinstance(item.get("role"), str):
            raise invalid(where, f"{where} must be an object with a string role")
        if item.get("tool_calls"):
            raise invalid(f"{where}.tool_calls", "tool calls are not supported by this server")
        message = serving_pb2.ChatMessage(role=item["role"], content=_content(item.get("content"), where))
        if isinstance(item.get("name"), str):
            message.name = item["name"]
        out.append(message)
    return out


def _content(content: object, where: str) -> str:
    """A message's text: a string, null, or a list of text parts (joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise invalid(
                    f"{where}.content[{j}]", "only text content parts ({type: text, text}) are supported"
                )
            parts.append(part["text"])
        return "".join(parts)
    raise invalid(f"{where}.content", f"{where}.content must be a string or a list of text parts")


def _is_id_list(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**32 for i in value
    )
