"""Chat-template rendering, tokenization and detokenization, off the event loop.

The tokenizer and the Jinja chat template run on one dedicated thread: the gRPC event loop never waits
on them (a long prompt takes milliseconds to encode), and a single thread keeps the transformers
tokenizer object free of concurrent use. Tokenize, Generate and Chat all go through here, so the
Tokenize RPC returns exactly the ids generation would use.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from google.protobuf import json_format

from coordinator.errors import invalid
from splitserve.v1 import serving_pb2

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RenderedChat:
    """A conversation after the chat template: its text and the prompt ids it tokenizes to."""

    text: str
    token_ids: list[int]


class TokenizerThread:
    """Owns the tokenizer's thread; created and closed by the coordinator app."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")

    async def _run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = await self._run(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)
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
        self, messages: Sequence[serving_pb2.ChatMessage], options: serving_pb2.ChatTemplateOptions
    ) -> RenderedChat:
        """Apply the model's chat template, then tokenize without adding special tokens again.

        A template that raises (roles out of order, a missing variable) is INVALID_ARGUMENT
        CHAT_TEMPLATE_FAILED carrying the template's own message.
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
        kwargs = json_format.MessageToDict(options.kwargs) if options.HasField("kwargs") else {}
        try:
            text = await self._run(
                self.tokenizer.apply_chat_template,
                conversation,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final,
                **kwargs,
            )
        except Exception as exc:  # the template is user-facing code: any failure is the request's
            raise invalid(
                "messages", f"the chat template failed: {exc}", reason="CHAT_TEMPLATE_FAILED"
            ) from None
        ids = await self.encode(text, add_special_tokens=False)
        return RenderedChat(text=text, token_ids=ids)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _message_dict(message: serving_pb2.ChatMessage) -> dict[str, str]:
    out = {"role": message.role, "content": message.content}
    if message.HasField("name"):
        out["name"] = message.name
    return out
