"""The real coordinator (gRPC server, ZeroMQ control plane) against scripted workers on loopback.

Each test drives the workers' side of control.proto by hand and checks what the client and the workers
see: the health transition, a stream assembled from PrefillDone + TokenBatch, cancellation fan-out,
ReserveFailed re-placement, preemption resume, and RESOURCE_EXHAUSTED on a full admission queue.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from splitserve.v1 import control_pb2, serving_pb2, serving_pb2_grpc
from splitserve.wire import unpack_ids
from tests.coordinator.conftest import Cluster

StartCluster = Callable[..., Awaitable[Cluster]]
LENGTH, EOS = serving_pb2.FINISH_REASON_LENGTH, serving_pb2.FINISH_REASON_EOS_TOKEN
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def greedy(text: str, max_tokens: int = 8, **kwargs: object) -> serving_pb2.GenerateRequest:
    return serving_pb2.GenerateRequest(
        text=text,
        sampling=serving_pb2.SamplingParams(temperature=0.0),
        stopping=serving_pb2.StoppingCriteria(max_tokens=max_tokens),
        **kwargs,  # type: ignore[arg-type]
    )


async def collect(call: grpc.aio.UnaryStreamCall) -> list[serving_pb2.GenerateResponse]:
    return [r async for r in call]


async def test_health_turns_serving_once_a_prefill_and_a_decode_worker_registered(start_cluster: StartCluster) -> None:
    cluster = await start_cluster()
    health = health_pb2_grpc.HealthStub(cluster.channel)
    watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
    seen = [(await watch.read()).status]
    assert seen == [NOT_SERVING]
    p = cluster.worker("p0", "prefill")
    assert (await p.register()).accepted
    check = await health.Check(health_pb2.HealthCheckRequest(service="splitserve.v1.InferenceService"))
    assert check.status == NOT_SERVING  # a prefill worker alone cannot serve
    d = cluster.worker("d0", "decode")
    ack = await d.register()
    assert ack.accepted and [peer.endpoint.worker_id for peer in ack.peers] == ["p0"]
    assert (await watch.read()).status == SERVING
    peers = (await p.expect("peers")).peers  # the prefill worker learns about the new decode worker
    assert [peer.endpoint.worker_id for peer in peers.peers] == ["d0"]
    watch.cancel()


async def test_registration_with_another_model_identity_is_refused_naming_the_field(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster()
    ack = await cluster.worker("p0", "prefill", identity="0" * 64).register()
    assert not ack.accepted and "model_identity" in ack.reason


async def test_generate_streams_prefill_and_decode_tokens_once_each(start_cluster: StartCluster) -> None:
    cluster = await start_cluster()
    p, d = await cluster.ready_pair()
    stub = serving_pb2_grpc.InferenceServiceStub(cluster.channel)
    text = "hello world"
    call = stub.Generate(greedy(text, max_tokens=4, request_id="r-1"), timeout=10)
    stream = asyncio.create_task(collect(call))

    prefill = (await p.expect("prefill")).prefill
    decode = (await d.expect("decode")).decode
    req = prefill.request
    assert req == decode.request and prefill.decode.worker_id == "d0" and decode.prefill.worker_id == "p0"
    assert unpack_ids(req.prompt_token_ids) == cluster.model.tokenizer.encode(text)
    assert req.stopping.max_tokens == 4 and req.sampling.temperature == 0.0 and req.sampling.seed > 0
    assert req.request_id == "r-1" and req.model_identity == cluster.model.identity

    out = [300, 301, 302, 303]
    await p.tokens(req.rid, req.generation, 0, out[:1], prefill_done=True)
    await d.tokens(req.rid, req.generation, 1, out[1:3])
    await d.tokens(req.rid, req.generation, 1, out[1:2])  # a duplicate: dropped
    await d.tokens(req.rid, req.generation, 3, out[3:], finish=LENGTH)
    responses = await stream

    deltas = [r.delta for r in responses if r.HasField("delta")]
    assert [i for delta in deltas for i in delta.token_ids] == out
    assert [delta.offset for delta in deltas] == [0, 1, 3][: len(deltas)] or deltas[0].offset == 0
    assert "".join(delta.text for delta in deltas) == cluster.model.tokenizer.decode(out)
    finished = responses[-1].finished
    assert responses[-1].request_id == "r-1" and finished.reason == LENGTH
    assert finished.usage.prompt_tokens == len(unpack_ids(req.prompt_token_ids))
    assert finished.usage.completion_tokens == 4
    assert finished.timings.prefill_ms == 2.5 and finished.timings.queue_ms >= 1.5
    assert finished.timings.total_ms >= finished.timings.first_token_ms > 0


async def test_client_cancel_sends_abort_with_a_bumped_generation_to_both_workers(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster()
    p, d = await cluster.ready_pair()
    stub = serving_pb2_grpc.InferenceServiceStub(cluster.channel)
    call = stub.Generate(greedy("cancel me"), timeout=10)
    req = (await p.expect("prefill")).prefill.request
    await d.expect("decode")
    await p.tokens(req.rid, req.generation, 0, [400], prefill_done=True)
    first = await call.read()
    assert list(first.delta.token_ids) == [400]
    call.cancel()
    for worker in (p, d):
        abort = (await worker.expect("abort")).abort
        assert (abort.rid, abort.generation) == (req.rid, req.generation + 1)
        assert abort.reason == control_pb2.ABORT_REASON_CLIENT_CANCELLED
    # a late output of the cancelled generation is dropped and counted, never delivered
    admin = serving_pb2_grpc.AdminServiceStub(cluster.channel)
    before = (await admin.GetPoolState(serving_pb2.GetPoolStateRequest())).late_outputs_dropped
    await d.tokens(req.rid, req.generation, 1, [401])
    await d.tokens(req.rid, req.generation, 2, [402])
    async with asyncio.timeout(5):  # bounded wait for the coordinator to process both messages
        while (await admin.GetPoolState(serving_pb2.GetPoolStateRequest())).late_outputs_dropped < before + 2:
            await asyncio.sleep(0.01)
    state = await admin.GetPoolState(serving_pb2.GetPoolStateRequest())
    assert state.active_requests == 0


async def test_deadline_ends_the_stream_and_aborts_the_workers(start_cluster: StartCluster) -> None:
    cluster = await start_cluster()
    p, d = await cluster.ready_pair()
    stub = serving_pb2_grpc.InferenceServiceStub(cluster.channel)
    call = stub.Generate(greedy("too slow"), timeout=0.5)
    req = (await p.expect("prefill")).prefill.request
    assert req.deadline_unix_ns > 0
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await collect(call)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    for worker in (p, d):
        abort = (await worker.expect("abort")).abort
        assert abort.reason == control_pb2.ABORT_REASON_DEADLINE_EXCEEDED
        assert abort.generation == req.generation + 1


async def test_reserve_failed_re_places_the_decode_and_reassigns_the_prefill(start_cluster: StartCluster) -> None:
    cluster = await start_cluster()
    p = cluster.worker("p0", "prefill")
    d_big, d_small = cluster.worker("d-big", "decode", num_blocks=64), cluster.worker("d-small", "decode", num_blocks=32)
    for w in (p, d_big, d_small):
        assert (await w.register()).accepted
    stub = serving_pb2_grpc.InferenceServiceStub(cluster.channel)
    stream = asyncio.create_task(collect(stub.Generate(greedy("re-place me", max_tokens=2), timeout=10)))
    req = (await d_big.expect("decode")).decode.request  # the one with the most free blocks first
    await d_big.send(
        reserve_failed=control_pb2.ReserveFailed(
            rid=req.rid, generation=req.generation, decode_worker_id="d-big", needed_blocks=2, available_blocks=0
        )
    )
    again = (await d_small.expect("decode")).decode
    assert again.request.rid == req.rid and again.request.generation == req.generation
    assert again.prefill.worker_id == "p0"
    reassign = (await p.expect("reassign")).reassign
    assert (reassign.rid, reassign.generation, reassign.decode.worker_id) == (req.rid, req.generation, "d-small")
    await p.tokens(req.rid, req.generation, 0, [500], prefill_done=True)
    await d_big.tokens(req.rid, req.generation, 1, [666])  # not the decode owner any more: dropped
    await d_small.tokens(req.rid, req.generation, 1, [501], finish=LENGTH)
    responses = await stream
    assert [i for r in responses if r.HasField("delta") for i in r.delta.token_ids] == [500, 501]


async def test_preempted_request_resumes_through_prefill_and_the_stream_continues(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster()
    p, d = await cluster.ready_pair()
    stub = serving_pb2_grpc.InferenceServiceStub(cluster.channel)
    stream = asyncio.create_task(collect(stub.Generate(greedy("preempt me", max_tokens=4), timeout=10)))
    req = (await p.expect("prefill")).prefill.request
    await d.expect("decode")
    await p.tokens(req.rid, req.generation, 0, [600], prefill_done=True)
    await d.tokens(req.rid, req.generation, 1, [601])
    await d.send(preempted=control_pb2.Preempted(rid=req.rid, generation=req.generation, num_output_tokens=2))
    resumed = (await p.expect("prefill")).prefill.request
    assert resumed.rid == req.rid and resumed.generation == req.generation + 1
    assert unpack_ids(resumed.output_token_ids) == [600, 601]
    assert resumed.prompt_token_ids == req.prompt_token_ids and resumed.sampling.seed == req.sampling.seed
    await d.expect("decode")
    await d.tokens(req.rid, req.generation, 2, [999])  # the preempted generation: dropped
    await p.tokens(req.rid, resumed.generation, 2, [602], prefill_done=True)
    await d.tokens(req.rid, resumed.generation, 3, [603], finish=LENGTH)
    responses = await stream
    assert [i for r in responses if r.HasField("delta") for i in r.delta.token_ids] == [600, 601, 602, 603]
    assert responses[-1].finished.usage.preemptions == 1


async def test_full_admission_queue_is_rejected_at_once_with_retry_info(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(max_queue=1)
    p, d = await cluster.ready_pair()
    await d.heartbeat(free_blocks=0)  # the decode pool is full: admitted requests wait in the queue
    admin = serving_pb2_grpc.AdminServiceStub(cluster.channel)
    async with asyncio.timeout(5):
        while (await admin.GetPoolState(serving_pb2.GetPoolStateRequest())).workers[1].pool.free_blocks:
            await asyncio.sleep(0.01)
    stub = serving_pb2_grpc.InferenceServiceStub(cluster.channel)
    waiting = asyncio.create_task(collect(stub.Generate(greedy("first", max_tokens=1), timeout=10)))
    async with asyncio.timeout(5):
        while (await admin.GetPoolState(serving_pb2.GetPoolStateRequest())).queued_requests < 1:
            await asyncio.sleep(0.01)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await collect(stub.Generate(greedy("second", max_tokens=1), timeout=10))
    err = caught.value
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue is full" in (err.details() or "")
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None
    info, retry = error_details_pb2.ErrorInfo(), error_details_pb2.RetryInfo()
    assert status.details[0].Unpack(info) and info.reason == "QUEUE_FULL"
    assert any(d.Unpack(retry) for d in status.details) and retry.retry_delay.ToNanoseconds() > 0
    # capacity comes back: the queued request is placed and completes
    await d.heartbeat(free_blocks=64)
    req = (await p.expect("prefill")).prefill.request
    await p.tokens(req.rid, req.generation, 0, [700], finish=LENGTH, prefill_done=True)
    assert (await waiting)[-1].finished.reason == LENGTH
