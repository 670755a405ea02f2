"""Chat-template rendering, tokenization and detokenization, off the event loop, each bounded.

Encoding and decoding run on one dedicated tokenizer thread: the gRPC event loop never waits on them (a
long prompt takes milliseconds to encode, and its size is bounded by admission), and a single thread
keeps the transformers tokenizer's Rust state free of concurrent use. Chat templates render on a small
separate pool (`TemplateLimits.render_threads`), so a slow template never delays a Tokenize or another
request's encode. Every render is bounded by the earlier of its render time limit and the call's
deadline (`render_guard.run_bounded` stops a template that runs past it) and by an output size limit.
The server's template is the model's: a request's `chat_template` kwarg is refused unless the operator
allows request templates. Tokenize, Generate and Chat all go through here, so the Tokenize RPC
returns exactly the ids generation would use.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from google.protobuf import json_format

from coordinator.config import TemplateLimits
from coordinator.errors import RpcError, clip, invalid
from coordinator.render_guard import RenderTimeout, run_bounded
from splitserve.v1 import serving_pb2

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RenderedChat:
    """A conversation after the chat template: its text and the prompt ids it tokenizes to."""

    text: str
    token_ids: list[int]


# apply_chat_template's own parameters: kwargs may pass template variables, never these
_RESERVED_KWARGS = frozenset(
    {"conversation", "tools", "documents", "add_generation_prompt", "continue_final_message", "tokenize",
     "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
     "tokenizer_kwargs"}
)  # fmt: skip
# the event loop stops waiting this long after the bound (the guard needs one template line to fire)
_WAIT_GRACE_S = 0.25


def deadline_exceeded(what: str) -> RpcError:
    return RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, None, f"the call's deadline passed during {what}")


class TokenizerThread:
    """Owns the tokenizer thread and the template pool; created and closed by the coordinator app."""

    def __init__(self, tokenizer: Any, limits: TemplateLimits | None = None) -> None:
        self.tokenizer = tokenizer
        self.limits = limits or TemplateLimits()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        self._templates = ThreadPoolExecutor(self.limits.render_threads, thread_name_prefix="chat-template")

    async def _run(
        self, fn: Callable[..., T], *args: Any, time_remaining: float | None = None, **kwargs: Any
    ) -> T:
        """`fn` on the tokenizer thread; DEADLINE_EXCEEDED when the call's deadline passes first (the
        thread finishes the size-bounded work and drops the result)."""
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))
        try:
            return await asyncio.wait_for(future, time_remaining)
        except TimeoutError:
            raise deadline_exceeded("tokenization") from None

    async def encode(
        self, text: str, add_special_tokens: bool = True, time_remaining: float | None = None
    ) -> list[int]:
        ids = await self._run(
            self.tokenizer.encode, text, add_special_tokens=add_special_tokens, time_remaining=time_remaining
        )
        return list(ids)

    async def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return await self._run(
            self.tokenizer.decode,
            list(token_ids),
            skip_special_tokens=skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    async def decode_each(self, token_ids: Sequence[int]) -> list[str]:
        """Each id's own text, special tokens included (the token strings of logprobs)."""
        return await self._run(
            self.tokenizer.batch_decode,
            [[i] for i in token_ids],
            skip_special_tokens=False,
            clean_up_tokenization_spaces=False,
        )

    async def render_chat(
        self,
        messages: Sequence[serving_pb2.ChatMessage],
        options: serving_pb2.ChatTemplateOptions,
        time_remaining: float | None = None,
    ) -> RenderedChat:
        """Apply the model's chat template, then tokenize without adding special tokens again.

        A template that raises (roles out of order, a missing variable), runs past its render limit or
        renders more than the size limit is INVALID_ARGUMENT CHAT_TEMPLATE_FAILED (carrying a bounded
        prefix of the template's own message); past the call's deadline it is DEADLINE_EXCEEDED. A
        `chat_template` kwarg is CHAT_TEMPLATE_NOT_ALLOWED unless the operator allows it.
        """
        conversation = [_message_dict(m) for m in messages]
        add_generation_prompt = (
            options.add_generation_prompt if options.HasField("add_generation_prompt") else True
        )
        continue_final = (
            options.continue_final_message if options.HasField("continue_final_message") else False
        )
        if add_generation_prompt and continue_final:
            raise invalid(
                "template.continue_final_message",
                "continue_final_message requires add_generation_prompt to be false",
            )
        kwargs = self._template_kwargs(options)
        render = functools.partial(
            self.tokenizer.apply_chat_template,
            conversation,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final,
            **kwargs,
        )
        started = time.monotonic()
        text = await self._render(render, time_remaining)
        if len(text) > self.limits.max_rendered_chars:
            raise invalid(
                "messages",
                f"the chat template rendered {len(text)} characters, over the server's limit of "
                f"{self.limits.max_rendered_chars}; send a shorter conversation",
                reason="CHAT_TEMPLATE_FAILED",
                rendered_chars=len(text),
                limit_chars=self.limits.max_rendered_chars,
            )
        left = None if time_remaining is None else time_remaining - (time.monotonic() - started)
        ids = await self.encode(text, add_special_tokens=False, time_remaining=left)
        return RenderedChat(text=text, token_ids=ids)

    def _template_kwargs(self, options: serving_pb2.ChatTemplateOptions) -> dict[str, Any]:
        """Template variables from `options.kwargs`; the template itself only when allowed."""
        kwargs = json_format.MessageToDict(options.kwargs) if options.HasField("kwargs") else {}
        if "chat_template" in kwargs and not self.limits.allow_request_template:
            raise invalid(
                "template.kwargs.chat_template",
                "this server renders the model's own chat template; a request template is refused "
                "(the operator can allow them with --allow-request-chat-template)",
                reason="CHAT_TEMPLATE_NOT_ALLOWED",
            )
        reserved = sorted(_RESERVED_KWARGS & kwargs.keys())
        if reserved:
            raise invalid(
                f"template.kwargs.{reserved[0]}",
                f"template.kwargs.{reserved[0]} is not a template variable: use the request's own fields",
            )
        return kwargs

    async def _render(self, render: Callable[[], str], time_remaining: float | None) -> str:
        """`render()` on the template pool, bounded by the render limit and the call's deadline."""
        limit = self.limits.render_timeout_s
        by_deadline = time_remaining is not None and time_remaining < limit
        bound = time_remaining if by_deadline and time_remaining is not None else limit
        deadline = time.monotonic() + max(bound, 0.0)
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._templates, run_bounded, render, deadline)
        try:
            return await asyncio.wait_for(future, max(bound, 0.0) + _WAIT_GRACE_S)
        except (RenderTimeout, TimeoutError):
            if by_deadline:
                raise deadline_exceeded("chat-template rendering") from None
            raise invalid(
                "messages",
                f"the chat template did not finish within the server's {limit * 1e3:.0f} ms render limit",
                reason="CHAT_TEMPLATE_FAILED",
                limit_ms=round(limit * 1e3),
            ) from None
        except Exception as exc:  # the template is user-facing code: any failure is the request's
            raise invalid(
                "messages", f"the chat template failed: {clip(exc, 200)}", reason="CHAT_TEMPLATE_FAILED"
            ) from None

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._templates.shutdown(wait=False, cancel_futures=True)


def _message_dict(message: serving_pb2.ChatMessage) -> dict[str, str]:
    out = {"role": message.role, "content": message.content}
    if message.HasField("name"):
        out["name"] = message.name
    return out
