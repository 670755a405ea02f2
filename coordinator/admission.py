"""Admission: the ordered checks that turn a Generate/Chat call into an execution request.

Cheap, decisive checks first (seed 000, "The ordering of these checks"; docs/api.md "Errors"):

    API key -> model -> parameter ranges -> request byte size -> chat template + tokenization
    (off the event loop) -> prompt + max_tokens <= context

The last two gates, a duplicate in-flight request_id and the bounded admission queue, belong to the
request table and the dispatcher (`Dispatcher.submit`). Each failed check raises `RpcError` naming the
field and what to fix; nothing is reserved or sent to a worker before every check has passed.
Parameter ranges are `engine.sampling_params.SamplingParams`'s own checks, not a copy of them.
"""

from __future__ import annotations

import re
import secrets
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.message import Message

from coordinator.auth import ANONYMOUS, Authenticator, Metadata, Principal, bearer_from_metadata
from coordinator.chat import TokenizerThread
from coordinator.errors import RpcError, clip, empty_prompt, invalid
from coordinator.served_model import ServedModel
from engine.sampling_params import SamplingParams
from splitserve.v1 import control_pb2, serving_pb2
from splitserve.wire import pack_ids

DEFAULT_MAX_TOKENS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_REQUEST_ID_CHARS = 128

# SamplingParams field -> the request path a rejection names
_FIELD_PATHS = {
    "temperature": "sampling.temperature",
    "top_p": "sampling.top_p",
    "top_k": "sampling.top_k",
    "min_p": "sampling.min_p",
    "repetition_penalty": "sampling.repetition_penalty",
    "presence_penalty": "sampling.presence_penalty",
    "frequency_penalty": "sampling.frequency_penalty",
    "seed": "sampling.seed",
    "max_tokens": "stopping.max_tokens",
    "min_tokens": "stopping.min_tokens",
    "stop": "stopping.stop",
    "stop_token_ids": "stopping.stop_token_ids",
    "logprobs": "output.logprobs",
}
_PRINTABLE_ASCII = re.compile(r"[\x20-\x7e]+")


@dataclass(slots=True)
class AdmittedRequest:
    """What admission produced. Immutable after admission; owned by the request's record."""

    request_id: str  # unique per principal, not globally
    model: ServedModel
    prompt_token_ids: list[int]
    params: SamplingParams  # resolved: max_tokens and seed are always set
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_prompt_token_ids: bool = False
    priority: int = 0
    deadline_unix_ns: int = 0
    arrival: float = field(default_factory=time.monotonic)
    packed_prompt: bytes = b""
    principal: Principal = ANONYMOUS  # the owner: only it can see or abort the request

    def __post_init__(self) -> None:
        self.packed_prompt = pack_ids(self.prompt_token_ids)

    def execution_request(
        self, rid: int, generation: int, output_token_ids: Sequence[int] = ()
    ) -> control_pb2.ExecutionRequest:
        """The worker's view: token ids and resolved knobs only (no text, no API key)."""
        p = self.params
        assert p.seed is not None
        request = control_pb2.ExecutionRequest(
            rid=rid,
            generation=generation,
            request_id=self.request_id,
            model=self.model.name,
            model_identity=self.model.identity,
            prompt_token_ids=self.packed_prompt,
            output_token_ids=pack_ids(list(output_token_ids)),
            sampling=control_pb2.Sampling(
                temperature=p.temperature,
                top_p=p.top_p,
                top_k=max(p.top_k, 0),
                min_p=p.min_p,
                repetition_penalty=p.repetition_penalty,
                presence_penalty=p.presence_penalty,
                frequency_penalty=p.frequency_penalty,
                seed=p.seed,
            ),
            stopping=control_pb2.Stopping(
                max_tokens=p.max_tokens,
                min_tokens=p.min_tokens,
                stop_token_ids=pack_ids(p.stop_token_ids),
                ignore_eos=p.ignore_eos,
            ),
            deadline_unix_ns=self.deadline_unix_ns,
            priority=self.priority,
        )
        if p.logprobs is not None:
            request.logprobs = p.logprobs
        return request


class Admission:
    """Stateless checks over one served model; shared by every call of the coordinator."""

    def __init__(
        self,
        model: ServedModel,
        tokenizer: TokenizerThread,
        *,
        auth: Authenticator | None = None,
        max_request_bytes: int = 1 << 20,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.auth = auth or Authenticator()
        self.max_request_bytes = max_request_bytes

    # -- the cheap checks, in order ------------------------------------------------------------
    def authenticate(self, metadata: Metadata | None) -> Principal:
        """The caller's principal from `authorization: Bearer <key>` (see coordinator.auth)."""
        return self.auth.authenticate(bearer_from_metadata(metadata))

    def check_model(self, name: str) -> None:
        """Empty means the only served model."""
        if name and name != self.model.name:
            raise RpcError(
                grpc.StatusCode.NOT_FOUND,
                "MODEL_NOT_FOUND",
                f"model {clip(name)!r} is not served here; use {self.model.name!r} (see ListModels)",
                metadata={"model": name},
            )

    def check_size(self, request: Message) -> None:
        size = request.ByteSize()
        if size > self.max_request_bytes:
            raise invalid(
                "request",
                f"the request is {size} bytes, over the server's limit of {self.max_request_bytes}; "
                "send a shorter prompt",
                reason="REQUEST_TOO_LARGE",
                request_bytes=size,
                limit_bytes=self.max_request_bytes,
            )

    def check_token_ids(self, ids: Sequence[int], path: str) -> None:
        if not ids or max(ids) < self.model.vocab_size:
            return
        for i, token_id in enumerate(ids):
            if token_id >= self.model.vocab_size:
                raise invalid(
                    f"{path}[{i}]",
                    f"{path}[{i}] = {token_id} is not a token id: the vocabulary has "
                    f"{self.model.vocab_size} ids (0 to {self.model.vocab_size - 1})",
                )

    # -- whole calls -----------------------------------------------------------------------------
    async def admit_generate(
        self,
        request: serving_pb2.GenerateRequest,
        metadata: Metadata | None,
        time_remaining: float | None,
        principal: Principal | None = None,
    ) -> AdmittedRequest:
        """`principal`: the caller, when the door already ran `authenticate` (the HTTP door does,
        before it reads the body); else the API key in `metadata` is checked here first."""
        if principal is None:
            principal = self.authenticate(metadata)
        self.check_model(request.model)
        params = self._params(request.sampling, request.stopping, request.output)
        request_id = _request_id(request.request_id)
        kind = request.WhichOneof("prompt")
        if kind == "token_ids":
            if not request.token_ids.ids:
                raise empty_prompt("token_ids", "token_ids is empty: send at least one prompt token id")
            self.check_token_ids(request.token_ids.ids, "token_ids.ids")
        elif not request.text:
            raise empty_prompt("text", "the prompt is empty: set a non-empty text or token_ids")
        self.check_size(request)
        if kind == "token_ids":
            ids, where = list(request.token_ids.ids), "token_ids"
        else:
            add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
            ids = await self.tokenizer.encode(request.text, add_special, time_remaining)
            where = "text"
        return self._finish(request, principal, request_id, params, ids, where, time_remaining)

    async def admit_chat(
        self,
        request: serving_pb2.ChatRequest,
        metadata: Metadata | None,
        time_remaining: float | None,
        principal: Principal | None = None,
    ) -> AdmittedRequest:
        """`principal`: the caller, when the door already ran `authenticate` (the HTTP door does,
        before it reads the body); else the API key in `metadata` is checked here first."""
        if principal is None:
            principal = self.authenticate(metadata)
        self.check_model(request.model)
        params = self._params(request.sampling, request.stopping, request.output)
        request_id = _request_id(request.request_id)
        if not request.messages:
            raise empty_prompt("messages", "messages is empty: send at least one chat message")
        self.check_size(request)
        rendered = await self.tokenizer.render_chat(request.messages, request.template, time_remaining)
        return self._finish(
            request, principal, request_id, params, rendered.token_ids, "messages", time_remaining
        )

    def _params(
        self,
        sampling: serving_pb2.SamplingParams,
        stopping: serving_pb2.StoppingCriteria,
        output: serving_pb2.OutputOptions,
    ) -> SamplingParams:
        """Every knob with its default, range-checked by SamplingParams; max_tokens may still drop."""
        given: dict[str, Any] = {f.name: value for f, value in sampling.ListFields()}
        given |= {
            f.name: value
            for f, value in stopping.ListFields()
            if f.name in ("max_tokens", "min_tokens", "ignore_eos")
        }
        given.setdefault("max_tokens", max(DEFAULT_MAX_TOKENS, given.get("min_tokens", 0)))
        if output.HasField("logprobs"):
            given["logprobs"] = output.logprobs
        if len(stopping.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise invalid(
                "stopping.stop_token_ids",
                f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got {len(stopping.stop_token_ids)}",
            )
        self.check_token_ids(stopping.stop_token_ids, "stopping.stop_token_ids")
        try:
            return SamplingParams(
                **given, stop=list(stopping.stop), stop_token_ids=list(stopping.stop_token_ids)
            )
        except ValueError as exc:
            raise invalid(_field_path(str(exc), stopping.stop), str(exc)) from None

    def _finish(
        self,
        request: serving_pb2.GenerateRequest | serving_pb2.ChatRequest,
        principal: Principal,
        request_id: str,
        params: SamplingParams,
        prompt: list[int],
        where: str,
        time_remaining: float | None,
    ) -> AdmittedRequest:
        """Token-limit checks on the tokenized prompt, then the resolved request."""
        n, context = len(prompt), self.model.context_length
        if n == 0:
            raise empty_prompt(where, f"the {where} tokenized to no tokens: send a non-empty prompt")
        if n >= context:
            raise invalid(
                where,
                f"the prompt has {n} tokens but the model's context holds {context}, leaving no room "
                "to generate; shorten the prompt",
                reason="PROMPT_TOO_LONG",
                prompt_tokens=n,
                context_length=context,
            )
        if request.stopping.HasField("max_tokens"):
            if n + params.max_tokens > context:
                raise invalid(
                    "stopping.max_tokens",
                    f"prompt tokens ({n}) + max_tokens ({params.max_tokens}) = {n + params.max_tokens} "
                    f"exceeds the context length ({context}); lower max_tokens to at most {context - n} "
                    "or shorten the prompt",
                    reason="CONTEXT_LENGTH_EXCEEDED",
                    prompt_tokens=n,
                    max_tokens=params.max_tokens,
                    context_length=context,
                )
        else:
            params.max_tokens = max(min(DEFAULT_MAX_TOKENS, context - n), params.min_tokens)
            if n + params.max_tokens > context:
                raise invalid(
                    "stopping.min_tokens",
                    f"prompt tokens ({n}) + min_tokens ({params.min_tokens}) exceeds the context length "
                    f"({context}); lower min_tokens to at most {context - n} or shorten the prompt",
                    reason="CONTEXT_LENGTH_EXCEEDED",
                    prompt_tokens=n,
                    max_tokens=params.max_tokens,
                    context_length=context,
                )
        if params.seed is None:
            params.seed = secrets.randbelow(2**63)
        output = request.output
        deadline = 0 if time_remaining is None else time.time_ns() + int(max(time_remaining, 0.0) * 1e9)
        return AdmittedRequest(
            request_id=request_id,
            model=self.model,
            prompt_token_ids=prompt,
            params=params,
            skip_special_tokens=output.skip_special_tokens
            if output.HasField("skip_special_tokens")
            else True,
            include_stop_str_in_output=request.stopping.include_stop_str_in_output,
            return_prompt_token_ids=output.return_prompt_token_ids,
            priority=request.priority,
            deadline_unix_ns=deadline,
            principal=principal,
        )


def _request_id(given: str) -> str:
    if not given:
        return uuid.uuid4().hex
    if len(given) > MAX_REQUEST_ID_CHARS or not _PRINTABLE_ASCII.fullmatch(given):
        raise invalid(
            "request_id",
            f"request_id must be 1 to {MAX_REQUEST_ID_CHARS} printable ASCII characters "
            f"(got {len(given)} characters); leave it empty to have one assigned",
        )
    return given


def _field_path(message: str, stop: Sequence[str]) -> str:
    """The request path of the field a SamplingParams message names (its first known field word).

    For a stop string of the wrong length ("..., got N") the path names the first one of length N.
    """
    for word in re.findall(r"[a-z_]+", message):
        if word in _FIELD_PATHS:
            path = _FIELD_PATHS[word]
            got = re.search(r"got (\d+)$", message)
            if word == "stop" and got and message.startswith("each"):
                index = next(i for i, s in enumerate(stop) if len(s) == int(got.group(1)))
                return f"{path}[{index}]"
            return path
    return "sampling"
