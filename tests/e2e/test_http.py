"""The OpenAI HTTP door end to end, driven by the official `openai` SDK against the real cluster.

Same cluster (1 prefill + 2 decode over UCX, API key required) as test_serving: greedy answers over
HTTP equal greedy answers over gRPC, streaming equals non-streaming, usage counts equal token counts,
a stop string spanning tokens, logprobs, the SDK's typed errors, and a stream dropped mid-way leaves
every pool clean.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest

from splitserve.cluster import LocalCluster
from tests.e2e.conftest import assert_pools_clean, client_for, openai_client, wait_quiescent

pytestmark = pytest.mark.xdist_group("e2e-cluster")

MESSAGES = [
    {"role": "system", "content": "You answer questions about Acme products."},
    {"role": "user", "content": "Why is my device blinking amber?"},
]


@pytest.fixture
async def sdk(cluster: LocalCluster) -> AsyncIterator[openai.AsyncOpenAI]:
    client = openai_client(cluster)
    yield client
    await client.close()


async def model_name(sdk: openai.AsyncOpenAI) -> str:
    [model] = (await sdk.models.list()).data
    return model.id


async def test_chat_over_http_equals_grpc_greedy_streamed_or_not(
    cluster: LocalCluster, sdk: openai.AsyncOpenAI
) -> None:
    model = await model_name(sdk)
    whole = await sdk.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=20, temperature=0, logprobs=True, top_logprobs=2
    )
    async with client_for(cluster) as grpc_client:
        want = await grpc_client.complete_chat(MESSAGES, max_tokens=20, temperature=0.0)
    assert want.usage is not None
    [choice] = whole.choices
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert whole.usage is not None
    assert whole.usage.completion_tokens == len(want.token_ids) == want.usage.completion_tokens
    assert whole.usage.prompt_tokens == want.usage.prompt_tokens
    assert choice.finish_reason == ("length" if len(want.token_ids) == 20 else "stop")
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert len(choice.logprobs.content) == len(want.token_ids)
    for entry in choice.logprobs.content:  # greedy: the sampled token is the most likely one
        assert len(entry.top_logprobs) == 2 and entry.logprob == entry.top_logprobs[0].logprob <= 0

    stream = await sdk.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)


async def test_completions_over_http_equal_grpc_greedy_with_logprobs(
    cluster: LocalCluster, sdk: openai.AsyncOpenAI
) -> None:
    model = await model_name(sdk)
    prompt = "The battery of the Acme router"
    async with client_for(cluster) as grpc_client:
        want = await grpc_client.complete(prompt, max_tokens=12, temperature=0.0, ignore_eos=True)
    whole = await sdk.completions.create(
        model=model, prompt=prompt, max_tokens=12, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    [choice] = whole.choices
    assert choice.text == want.text and choice.finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 12 == len(want.token_ids)
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    assert len(choice.logprobs.token_logprobs) == 12 and all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    assert choice.logprobs.top_logprobs is not None
    assert all(1 <= len(top) <= 2 for top in choice.logprobs.top_logprobs)
    streamed = await sdk.completions.create(
        model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    assert "".join([c.choices[0].text async for c in streamed if c.choices]) == want.text


async def test_stop_string_spanning_tokens_over_http(sdk: openai.AsyncOpenAI) -> None:
    model = await model_name(sdk)
    kwargs = {"model": model, "prompt": "Reset the router", "max_tokens": 32, "temperature": 0}
    full = (await sdk.completions.create(**kwargs, extra_body={"ignore_eos": True})).choices[0].text
    stop = full[5:12]  # starts inside one token and ends inside a later one
    assert len(stop) == 7
    cut = (await sdk.completions.create(**kwargs, stop=[stop], extra_body={"ignore_eos": True})).choices[0]
    assert cut.text == full[: full.index(stop)] and cut.finish_reason == "stop"


async def test_sdk_raises_its_typed_errors(cluster: LocalCluster, sdk: openai.AsyncOpenAI) -> None:
    model = await model_name(sdk)
    stranger = openai_client(cluster, api_key="nope")
    with pytest.raises(openai.AuthenticationError) as unauthenticated:
        await stranger.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4)
    await stranger.close()
    assert unauthenticated.value.status_code == 401 and unauthenticated.value.code == "api_key_invalid"
    with pytest.raises(openai.NotFoundError):
        await sdk.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=4)
    with pytest.raises(openai.BadRequestError) as bad:
        await sdk.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, n=2)
    assert bad.value.param == "n"
    with pytest.raises(openai.BadRequestError) as too_long:
        await sdk.completions.create(model=model, prompt="hi", max_tokens=10**6)
    assert too_long.value.code == "context_length_exceeded" and too_long.value.param == "max_tokens"


async def test_a_stream_dropped_mid_way_leaves_every_pool_clean(
    cluster: LocalCluster, sdk: openai.AsyncOpenAI
) -> None:
    model = await model_name(sdk)
    stream = await sdk.completions.create(
        model=model,
        prompt="Tell me everything",
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    seen = 0
    async for chunk in stream:
        seen += bool(chunk.choices and chunk.choices[0].text)
        if seen == 3:
            break
    await stream.close()  # drops the connection mid-answer
    async with client_for(cluster) as grpc_client:
        assert_pools_clean(await wait_quiescent(grpc_client))
