"""Admission never waits on the impossible: a prompt no decode pool could hold is refused at once, and
a queued request that cannot be placed now does not hold the requests behind it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import grpc
import pytest

from splitserve.v1 import serving_pb2 as pb
from tests.coordinator.conftest import Cluster
from tests.coordinator.test_integration import collect

StartCluster = Callable[..., Awaitable[Cluster]]


def prompt(n: int, max_tokens: int = 2) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[5] * n),
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_tokens=max_tokens),
    )


async def test_a_never_fitting_prompt_is_refused_at_once_and_the_requests_behind_it_are_served(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster()
    p, d = await cluster.ready_pair(num_blocks=4)  # 4 blocks x 16 tokens: 63 prompt tokens at most
    stub = cluster.inference
    with pytest.raises(grpc.aio.AioRpcError) as caught:  # no deadline: it must not wait for one
        await asyncio.wait_for(collect(stub.Generate(prompt(100))), 10)
    err = caught.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "largest decode worker holds 4 blocks (64 tokens)" in (err.details() or "")
    assert (await cluster.admin.GetPoolState(pb.GetPoolStateRequest())).active_requests == 0

    # the pool is busy: a 40-token request (3 blocks) cannot be placed now, a 10-token one can
    await d.heartbeat(free_blocks=2)
    async with asyncio.timeout(5):  # bounded wait for the report to land
        while (await cluster.admin.GetPoolState(pb.GetPoolStateRequest())).workers[1].pool.free_blocks != 2:
            await asyncio.sleep(0.01)
    big = asyncio.ensure_future(collect(stub.Generate(prompt(40), timeout=20)))
    small = asyncio.ensure_future(collect(stub.Generate(prompt(10), timeout=20)))
    req = (await p.expect("prefill")).prefill.request
    assert len(req.prompt_token_ids) // 4 == 10 and not big.done()  # the small one went first
    await p.tokens(req.rid, req.generation, 0, [7], prefill_done=True)
    await d.tokens(req.rid, req.generation, 1, [8], finish=pb.FINISH_REASON_LENGTH)
    assert [i for r in await small if r.HasField("delta") for i in r.delta.token_ids] == [7, 8]
    await d.heartbeat()  # room again: the big one is placed too
    big_req = (await p.expect("prefill")).prefill.request
    assert len(big_req.prompt_token_ids) // 4 == 40
    await p.tokens(big_req.rid, big_req.generation, 0, [9], prefill_done=True)
    await d.tokens(big_req.rid, big_req.generation, 1, [10], finish=pb.FINISH_REASON_LENGTH)
    assert (await big)[-1].finished.reason == pb.FINISH_REASON_LENGTH
