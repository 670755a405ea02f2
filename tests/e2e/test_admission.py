"""Bad input gets its documented status and a message that says what to fix; nothing else is touched."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import grpc
import pytest

from splitserve.cluster import LocalCluster
from tests.e2e.conftest import API_KEY, assert_pools_clean, client_for, error_reason, wait_quiescent

pytestmark = pytest.mark.xdist_group("e2e-cluster")

INVALID = grpc.StatusCode.INVALID_ARGUMENT

# (case, client api key, client kwargs for `complete`, expected status, reason, words the message must name)
BAD_INPUTS: list[tuple[str, str | None, dict[str, Any], grpc.StatusCode, str, str]] = [
    ("missing api key", None, {}, grpc.StatusCode.UNAUTHENTICATED, "API_KEY_MISSING", "authorization"),
    ("invalid api key", "wrong", {}, grpc.StatusCode.UNAUTHENTICATED, "API_KEY_INVALID", "key"),
    (
        "unknown model",
        API_KEY,
        {"model": "no-such-model"},
        grpc.StatusCode.NOT_FOUND,
        "MODEL_NOT_FOUND",
        "no-such-model",
    ),
    ("empty prompt", API_KEY, {"prompt": ""}, INVALID, "EMPTY_PROMPT", "prompt"),
    ("negative temperature", API_KEY, {"temperature": -1.0}, INVALID, "INVALID_PARAMETER", "temperature"),
    ("nan top_p", API_KEY, {"top_p": math.nan}, INVALID, "INVALID_PARAMETER", "top_p"),
    (
        "too many stop strings",
        API_KEY,
        {"stop": [f"s{i}" for i in range(64)]},
        INVALID,
        "INVALID_PARAMETER",
        "stop",
    ),
    ("stop string too long", API_KEY, {"stop": ["x" * 5000]}, INVALID, "INVALID_PARAMETER", "stop"),
    (
        "prompt over the context",
        API_KEY,
        {"prompt": [5] * 3000},
        INVALID,
        "PROMPT_TOO_LONG",
        "context",
    ),
    (
        "prompt + max_tokens over the context",
        API_KEY,
        {"prompt": [5] * 2000, "max_tokens": 500},
        INVALID,
        "CONTEXT_LENGTH_EXCEEDED",
        "max_tokens",
    ),
    ("oversized message", API_KEY, {"prompt": "a" * (3 << 20)}, INVALID, "REQUEST_TOO_LARGE", "bytes"),
]


async def _expect_rejection(
    cluster: LocalCluster,
    key: str | None,
    kwargs: dict[str, Any],
    code: grpc.StatusCode,
    reason: str,
    names: str,
) -> None:
    kwargs = dict(kwargs)
    prompt = kwargs.pop("prompt", "Hello")
    model = kwargs.pop("model", "")
    async with client_for(cluster, key, model) as client:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await client.complete(prompt, **{"max_tokens": 4, **kwargs})
    err = caught.value
    assert err.code() == code, err.details()
    assert names in (err.details() or ""), f"message does not name {names!r}: {err.details()}"
    assert error_reason(err) == reason


async def test_bad_inputs_are_rejected_while_a_canary_streams(cluster: LocalCluster) -> None:
    async with client_for(cluster) as client:
        canary = asyncio.create_task(
            client.complete("Canary", max_tokens=48, temperature=0.0, ignore_eos=True)
        )
        for _case, key, kwargs, code, reason, names in BAD_INPUTS:
            await _expect_rejection(cluster, key, kwargs, code, reason, names)
        done = await canary
        assert len(done.token_ids) == 48 and done.finish_reason == "FINISH_REASON_LENGTH"
        alone = await client.complete("Canary", max_tokens=48, temperature=0.0, ignore_eos=True)
        assert alone.token_ids == done.token_ids
        assert_pools_clean(await wait_quiescent(client))


async def test_duplicate_in_flight_request_id_is_already_exists(cluster: LocalCluster) -> None:
    async with client_for(cluster) as client:
        first = client.generate(
            "Long one", request_id="dup-1", max_tokens=200, ignore_eos=True, temperature=0.0
        )
        assert (await first.read()).WhichOneof("event") == "delta"  # admitted and streaming
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await client.complete("Second", request_id="dup-1", max_tokens=4)
        assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "dup-1" in (caught.value.details() or "")
        last = None
        while (event := await first.read()) is not grpc.aio.EOF:
            last = event
        assert last is not None and last.WhichOneof("event") == "finished"
        assert_pools_clean(await wait_quiescent(client))
