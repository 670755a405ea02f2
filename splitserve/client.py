"""A small async Python client over the generated gRPC stubs.

    async with Client("127.0.0.1:50051") as client:
        async for event in client.generate("Hello", max_tokens=16):
            ...
        result = await client.complete_chat([{"role": "user", "content": "Hi"}])

TLS: pass `tls=ClientTls(ca=..., cert=..., key=...)` (a cert/key pair for mTLS). Without it the
channel is plaintext, which the client allows only to a loopback target unless `insecure=True`.
Inference calls carry `api_key`, AdminService calls (`pool_state`) the separate `admin_key`.
`generate`/`chat` yield the server's response messages as they stream; `complete`/`complete_chat`
collect one stream into a `Completion`. Errors surface as `grpc.aio.AioRpcError` with the server's
status code and message.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from coordinator.tls import ClientTls, host_of, is_loopback
from splitserve.v1 import serving_pb2, serving_pb2_grpc

Message = dict[str, str]


@dataclass(slots=True)
class Completion:
    """One whole streamed answer, assembled by the client."""

    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    matched_stop: str | int | None = None
    usage: serving_pb2.Usage | None = None
    timings: serving_pb2.Timings | None = None
    num_deltas: int = 0

    def add(self, event: Any) -> None:
        """Fold one GenerateResponse/ChatResponse into the completion."""
        self.request_id = event.request_id
        kind = event.WhichOneof("event")
        if kind == "delta":
            self.text += event.delta.text
            self.token_ids.extend(event.delta.token_ids)
            self.num_deltas += 1
        elif kind == "finished":
            fin = event.finished
            self.finish_reason = serving_pb2.FinishReason.Name(fin.reason)
            stop_kind = fin.WhichOneof("matched_stop")
            self.matched_stop = getattr(fin, stop_kind) if stop_kind else None
            self.usage, self.timings = fin.usage, fin.timings


def sampling_params(**kw: Any) -> tuple[serving_pb2.SamplingParams, serving_pb2.StoppingCriteria]:
    """Split keyword arguments into the request's sampling and stopping messages (unset = default)."""
    sampling_fields = set(serving_pb2.SamplingParams.DESCRIPTOR.fields_by_name)
    stopping_fields = set(serving_pb2.StoppingCriteria.DESCRIPTOR.fields_by_name)
    unknown = set(kw) - sampling_fields - stopping_fields
    if unknown:
        raise TypeError(f"unknown generation parameters: {sorted(unknown)}")
    sampling = {k: v for k, v in kw.items() if k in sampling_fields and v is not None}
    stopping = {k: v for k, v in kw.items() if k in stopping_fields and v is not None}
    return serving_pb2.SamplingParams(**sampling), serving_pb2.StoppingCriteria(**stopping)


class Client:
    """Owns one gRPC channel; close it with `close()` or `async with`."""

    def __init__(
        self,
        target: str,
        *,
        api_key: str | None = None,
        admin_key: str | None = None,
        model: str = "",
        tls: ClientTls | None = None,
        insecure: bool = False,
    ) -> None:
        if tls is not None:
            self.channel = grpc.aio.secure_channel(target, tls.credentials())
        elif insecure or is_loopback(host_of(target)):
            self.channel = grpc.aio.insecure_channel(target)
        else:
            raise ValueError(
                f"refusing a plaintext channel to {target!r} (not loopback): pass a CA for TLS "
                "(--tls-ca) or insecure=True (--insecure) to send keys and prompts unencrypted"
            )
        self.inference = serving_pb2_grpc.InferenceServiceStub(self.channel)
        self.models = serving_pb2_grpc.ModelServiceStub(self.channel)
        self.admin = serving_pb2_grpc.AdminServiceStub(self.channel)
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self.admin_metadata = (("authorization", f"Bearer {admin_key}"),) if admin_key else ()
        self.model = model

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    def _common_fields(self, request_id: str, params: dict[str, Any]) -> dict[str, Any]:
        """The fields Generate and Chat requests share: model, request id, sampling, stopping."""
        sampling, stopping = sampling_params(**params)
        return {"model": self.model, "request_id": request_id, "sampling": sampling, "stopping": stopping}

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        request_id: str = "",
        timeout: float | None = None,
        logprobs: int | None = None,
        **params: Any,
    ) -> AsyncIterator[serving_pb2.GenerateResponse]:
        req = serving_pb2.GenerateRequest(
            **self._common_fields(request_id, params), output=serving_pb2.OutputOptions(logprobs=logprobs)
        )
        if isinstance(prompt, str):
            req.text = prompt
        else:
            req.token_ids.ids.extend(prompt)
        return self.inference.Generate(req, timeout=timeout, metadata=self.metadata)

    def chat(
        self,
        messages: Sequence[Message],
        *,
        request_id: str = "",
        timeout: float | None = None,
        **params: Any,
    ) -> AsyncIterator[serving_pb2.ChatResponse]:
        req = serving_pb2.ChatRequest(
            **self._common_fields(request_id, params),
            messages=[serving_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages],
        )
        return self.inference.Chat(req, timeout=timeout, metadata=self.metadata)

    async def complete(self, prompt: str | Sequence[int], **kw: Any) -> Completion:
        completion = Completion()
        async for event in self.generate(prompt, **kw):
            completion.add(event)
        return completion

    async def complete_chat(self, messages: Sequence[Message], **kw: Any) -> Completion:
        completion = Completion()
        async for event in self.chat(messages, **kw):
            completion.add(event)
        return completion

    async def abort(self, request_id: str) -> None:
        await self.inference.Abort(serving_pb2.AbortRequest(request_id=request_id), metadata=self.metadata)

    async def list_models(self) -> list[serving_pb2.Model]:
        reply = await self.models.ListModels(serving_pb2.ListModelsRequest(), metadata=self.metadata)
        return list(reply.models)

    async def pool_state(self, fresh: bool = True) -> serving_pb2.GetPoolStateResponse:
        return await self.admin.GetPoolState(
            serving_pb2.GetPoolStateRequest(fresh=fresh), metadata=self.admin_metadata
        )
