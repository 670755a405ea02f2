"""Chat templates over the real coordinator: the model's template only (unless allowed), and every
render bounded in time and size without stalling other calls."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import grpc
import pytest
from google.protobuf import struct_pb2
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from coordinator.chat import TemplateLimits
from splitserve.v1 import serving_pb2 as pb
from tests.coordinator.conftest import Cluster

StartCluster = Callable[..., Awaitable[Cluster]]
LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}never"


def chat_tokenize(content: str = "hi", **template_kwargs: object) -> pb.TokenizeRequest:
    kwargs = struct_pb2.Struct()
    kwargs.update(template_kwargs)
    options = pb.ChatTemplateOptions(kwargs=kwargs) if template_kwargs else pb.ChatTemplateOptions()
    messages = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=content)])
    return pb.TokenizeRequest(chat=messages, template=options)


def reason(err: grpc.aio.AioRpcError) -> str:
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None
    info = error_details_pb2.ErrorInfo()
    status.details[0].Unpack(info)
    return info.reason


async def refused(call: Awaitable[object]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


async def test_a_request_template_is_refused_by_default(start_cluster: StartCluster) -> None:
    cluster = await start_cluster()
    stub = cluster.inference
    err = await refused(stub.Tokenize(chat_tokenize(chat_template="{{ 'mine' }}"), timeout=10))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and reason(err) == "CHAT_TEMPLATE_NOT_ALLOWED"
    assert "--allow-request-chat-template" in (err.details() or "")
    chat = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="hi")])
    chat.template.kwargs.update({"chat_template": "{{ 'mine' }}"})
    err = await refused(stub.Chat(chat, timeout=10).read())
    assert reason(err) == "CHAT_TEMPLATE_NOT_ALLOWED"
    err = await refused(stub.Tokenize(chat_tokenize(tokenize=True), timeout=10))  # not a template variable
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "template.kwargs.tokenize" in (
        err.details() or ""
    )
    # the model's own template, with a template variable, still renders
    ok = await stub.Tokenize(chat_tokenize(some_flag=True), timeout=10)
    assert ok.rendered_prompt and list(ok.token_ids)


async def test_a_looping_template_ends_at_its_bound_while_tokenize_is_served(
    start_cluster: StartCluster,
) -> None:
    limits = TemplateLimits(allow_request_template=True, render_timeout_s=3.0, render_threads=1)
    cluster = await start_cluster(templates=limits)
    stub = cluster.inference
    looping = asyncio.ensure_future(stub.Tokenize(chat_tokenize(chat_template=LOOP), timeout=30))
    plain = await stub.Tokenize(pb.TokenizeRequest(text="hello"), timeout=30)
    assert list(plain.token_ids) == cluster.model.tokenizer.encode("hello")
    assert not looping.done()  # served while the template still runs: not stuck behind it
    err = await refused(looping)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and reason(err) == "CHAT_TEMPLATE_FAILED"
    assert "3000 ms render limit" in (err.details() or "")

    # the call's deadline bounds the render too, and the one template thread is free again afterwards
    err = await refused(stub.Tokenize(chat_tokenize(chat_template=LOOP), timeout=0.5))
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    again = await stub.Tokenize(chat_tokenize(), timeout=2.5)
    conversation = [{"role": "user", "content": "hi"}]
    assert again.rendered_prompt == cluster.model.tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True
    )


async def test_a_rendered_prompt_over_the_size_limit_is_refused(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(templates=TemplateLimits(max_rendered_chars=200))
    err = await refused(cluster.inference.Tokenize(chat_tokenize("x" * 300), timeout=10))
    assert reason(err) == "CHAT_TEMPLATE_FAILED" and "over the server's limit of 200" in (err.details() or "")
