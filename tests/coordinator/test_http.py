"""The OpenAI HTTP door of the real coordinator, against scripted workers on loopback.

Each test speaks real HTTP to the coordinator's uvicorn listener and plays the workers' side of
control.proto by hand: SSE framing and usage, a stop string spanning tokens, every documented error
code in OpenAI's shape (driven for real: no workers, a full queue, a deadline, a small body limit), and
a client disconnect reaching the workers as the same Abort a gRPC cancel sends.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx2
import pytest

from splitserve.v1 import control_pb2, serving_pb2
from tests.coordinator.conftest import Cluster

StartCluster = Callable[..., Awaitable[Cluster]]
LENGTH = serving_pb2.FINISH_REASON_LENGTH
CHAT = {"messages": [{"role": "user", "content": "Why is my device blinking amber?"}], "temperature": 0}


def http(cluster: Cluster, key: str | None = None) -> httpx2.AsyncClient:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx2.AsyncClient(base_url=f"http://{cluster.app.http_address}", headers=headers, timeout=10)


def sse_data(raw: str) -> list[str]:
    """The `data:` payloads of an SSE body; fails on any line that is not `data: ...` or blank."""
    events = raw.split("\n\n")
    assert events[-1] == "", "the stream must end with a blank line"
    for event in events[:-1]:
        assert event.startswith("data: ") and "\n" not in event, f"not an SSE data event: {event!r}"
    return [e.removeprefix("data: ") for e in events[:-1]]


async def pool_state(cluster: Cluster) -> serving_pb2.GetPoolStateResponse:
    return await cluster.admin.GetPoolState(serving_pb2.GetPoolStateRequest())


async def test_chat_stream_is_sse_with_role_content_finish_usage_and_done(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster()
    p, d = await cluster.ready_pair()
    out = [300, 301, 302, 303]
    body = CHAT | {"max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    async with http(cluster) as client:
        call = asyncio.create_task(client.post("/v1/chat/completions", json=body))
        req = (await p.expect("prefill")).prefill.request
        assert req.stopping.max_tokens == 4 and req.sampling.temperature == 0.0
        await p.tokens(req.rid, req.generation, 0, out[:1], prefill_done=True)
        await d.tokens(req.rid, req.generation, 1, out[1:], finish=LENGTH)
        response = await call
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    data = sse_data(response.text)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(x) for x in data[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert content == cluster.model.tokenizer.decode(out)
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finish[-1] == "length" and all(f is None for f in finish[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and all(c["usage"] is None for c in chunks[:-1])
    usage = usage_chunk["usage"]
    assert usage["completion_tokens"] == len(out)
    assert usage["prompt_tokens"] == len(req.prompt_token_ids) // 4  # packed uint32
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


async def test_completion_stop_string_spanning_tokens_cuts_the_text_and_aborts(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster()
    p, d = await cluster.ready_pair()
    ids = cluster.model.tokenizer.encode(" the device is blinking amber", add_special_tokens=False)
    body = {"prompt": "why?", "max_tokens": 16, "temperature": 0, "stop": " is bl"}
    async with http(cluster) as client:
        call = asyncio.create_task(client.post("/v1/completions", json=body))
        req = (await p.expect("prefill")).prefill.request
        await p.tokens(req.rid, req.generation, 0, ids[:1], prefill_done=True)
        await d.tokens(req.rid, req.generation, 1, ids[1:])  # the worker cannot see text: it goes on
        abort = (await d.expect("abort")).abort
        assert abort.reason == control_pb2.ABORT_REASON_STOP_STRING
        response = await call
    assert response.status_code == 200, response.text
    answer = response.json()
    [choice] = answer["choices"]
    assert answer["object"] == "text_completion"
    assert choice["text"] == " the device" and choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == " is bl"


async def test_every_admission_error_is_openai_shaped_with_its_http_code(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(api_keys=("key",), max_request_bytes=2000)
    cases: list[tuple[str, dict[str, Any] | None, str | None, int, str, str | None]] = [
        # (path, body, key, status, code, param)
        ("/v1/chat/completions", CHAT, None, 401, "api_key_missing", None),
        ("/v1/chat/completions", CHAT, "wrong", 401, "api_key_invalid", None),
        ("/v1/models", None, "wrong", 401, "api_key_invalid", None),
        ("/v1/chat/completions", CHAT | {"model": "gpt-4"}, "key", 404, "model_not_found", None),
        ("/v1/models/gpt-4", None, "key", 404, "model_not_found", None),
        ("/v1/nowhere", None, "key", 404, "route_not_found", None),
        ("/v1/chat/completions", CHAT | {"n": 2}, "key", 400, "invalid_parameter", "n"),
        ("/v1/chat/completions", CHAT | {"temperature": -1}, "key", 400, "invalid_parameter", "temperature"),
        ("/v1/chat/completions", CHAT | {"top_logprobs": 99, "logprobs": True}, "key", 400, "invalid_parameter",
         "top_logprobs"),
        ("/v1/chat/completions", CHAT | {"tools": [{"type": "function"}]}, "key", 400, "invalid_parameter",
         "tools"),
        ("/v1/completions", {"prompt": ""}, "key", 400, "empty_prompt", "prompt"),
        ("/v1/completions", {"prompt": [1, 2**20]}, "key", 400, "invalid_parameter", "prompt"),
        ("/v1/completions", {"prompt": "x" * 3000}, "key", 413, "request_too_large", None),
        # every check passed, but no worker is registered: 503 with Retry-After
        ("/v1/chat/completions", CHAT, "key", 503, "model_not_ready", None),
    ]  # fmt: skip
    for path, body, key, status, code, param in cases:
        async with http(cluster, key) as client:
            response = await (client.get(path) if body is None else client.post(path, json=body))
        assert response.status_code == status, (path, body, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == code and error["param"] == param and error["message"], error
        if status == 503:
            assert int(response.headers["retry-after"]) >= 1
    async with http(cluster) as client:
        assert (await client.get("/health")).status_code == 503  # a probe needs no key


async def test_full_queue_is_429_with_retry_after(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(max_queue=1)
    p, d = await cluster.ready_pair()
    await d.heartbeat(free_blocks=0)  # the decode pool is full: admitted requests wait in the queue
    async with asyncio.timeout(5):
        while (await pool_state(cluster)).workers[1].pool.free_blocks:
            await asyncio.sleep(0.01)
    async with http(cluster) as client:
        waiting = asyncio.create_task(
            client.post("/v1/completions", json={"prompt": "first", "max_tokens": 1})
        )
        async with asyncio.timeout(5):
            while (await pool_state(cluster)).queued_requests < 1:
                await asyncio.sleep(0.01)
        response = await client.post("/v1/completions", json={"prompt": "second", "max_tokens": 1})
        assert response.status_code == 429
        assert response.json()["error"]["code"] == "queue_full"
        assert response.json()["error"]["type"] == "rate_limit_error"
        assert int(response.headers["retry-after"]) >= 1
        await d.heartbeat(free_blocks=64)  # capacity comes back: the queued request completes
        req = (await p.expect("prefill")).prefill.request
        await p.tokens(req.rid, req.generation, 0, [700], finish=LENGTH, prefill_done=True)
        assert (await waiting).json()["choices"][0]["finish_reason"] == "length"


async def test_deadline_is_504_and_aborts_the_workers(start_cluster: StartCluster) -> None:
    cluster = await start_cluster()
    p, d = await cluster.ready_pair()
    async with http(cluster) as client:
        headers = {"X-Request-Timeout": "0.5"}
        response = await client.post("/v1/completions", json={"prompt": "too slow"}, headers=headers)
    assert response.status_code == 504
    assert response.json()["error"]["type"] == "timeout_error"
    req = (await p.expect("prefill")).prefill.request
    assert req.deadline_unix_ns > 0
    for worker in (p, d):
        abort = (await worker.expect("abort")).abort
        assert abort.reason == control_pb2.ABORT_REASON_DEADLINE_EXCEEDED
        assert abort.generation == req.generation + 1


async def test_a_deadline_passing_mid_stream_ends_the_sse_with_an_error_event(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster()
    p, d = await cluster.ready_pair()
    body = {"prompt": "slow", "stream": True}
    async with http(cluster) as client:
        headers = {"X-Request-Timeout": "1"}
        call = asyncio.create_task(client.post("/v1/completions", json=body, headers=headers))
        req = (await p.expect("prefill")).prefill.request
        await p.tokens(req.rid, req.generation, 0, [500], prefill_done=True)  # then nothing more
        response = await call
    assert response.status_code == 200  # the stream had begun
    data = sse_data(response.text)
    assert "[DONE]" not in data
    assert json.loads(data[-1])["error"]["type"] == "timeout_error"
    abort = (await d.expect("abort")).abort
    assert abort.reason == control_pb2.ABORT_REASON_DEADLINE_EXCEEDED


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_sends_the_same_abort_as_a_grpc_cancel(
    start_cluster: StartCluster, stream: bool
) -> None:
    cluster = await start_cluster()
    p, d = await cluster.ready_pair()
    body = CHAT | {"max_tokens": 64, "stream": stream}
    first_chunk = asyncio.Event()

    async def talk(client: httpx2.AsyncClient) -> None:
        if not stream:
            await client.post("/v1/chat/completions", json=body)
            return
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert (await anext(response.aiter_lines())).startswith("data: ")  # the role chunk
            first_chunk.set()
            await asyncio.Event().wait()  # reads nothing more until cancelled

    async with http(cluster) as client:
        call = asyncio.create_task(talk(client))
        req = (await p.expect("prefill")).prefill.request
        await p.tokens(req.rid, req.generation, 0, [400], prefill_done=True)
        if stream:
            await first_chunk.wait()
        call.cancel()  # the client goes away mid-answer: its connection closes
        with pytest.raises(asyncio.CancelledError):
            await call
    for worker in (p, d):
        abort = (await worker.expect("abort")).abort
        assert (abort.rid, abort.generation) == (req.rid, req.generation + 1)
        assert abort.reason == control_pb2.ABORT_REASON_CLIENT_CANCELLED
    assert (await pool_state(cluster)).active_requests == 0
