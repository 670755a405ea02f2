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

from coordinator.routing_policy import FIRST_TOKEN_FROM, RoutingPolicy
from splitserve.v1 import control_pb2, serving_pb2
from splitserve.wire import unpack_ids
from tests.coordinator.conftest import Cluster
from tests.coordinator.peer import ScriptedWorker

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
    """Every remaining response of a stream (read() style, so it may follow earlier reads)."""
    out = []
    while (response := await call.read()) is not grpc.aio.EOF:
        out.append(response)
    return out


async def test_health_turns_serving_once_a_prefill_and_a_decode_worker_registered(
    start_cluster: StartCluster,
) -> None:
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
    stub = cluster.inference
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
    starts = [sum(len(x.token_ids) for x in deltas[:i]) for i in range(len(deltas))]
    assert [delta.offset for delta in deltas] == starts  # each delta starts where the previous ended
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
    stub = cluster.inference
    call = stub.Generate(greedy("cancel me"), timeout=10)
    req = (await p.expect("prefill")).prefill.request
    await d.expect("decode")
    await p.tokens(req.rid, req.generation, 0, [400], prefill_done=True)
    await d.tokens(req.rid, req.generation, 0, [400])  # D's first step: token 1 streams (the default)
    first = await call.read()
    assert list(first.delta.token_ids) == [400]
    call.cancel()
    for worker in (p, d):
        abort = (await worker.expect("abort")).abort
        assert (abort.rid, abort.generation) == (req.rid, req.generation + 1)
        assert abort.reason == control_pb2.ABORT_REASON_CLIENT_CANCELLED
    # a late output of the cancelled generation is dropped and counted, never delivered
    admin = cluster.admin
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
    stub = cluster.inference
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


async def one_prefill_two_decoders(cluster: Cluster) -> tuple[ScriptedWorker, ScriptedWorker, ScriptedWorker]:
    """Registered p0, d-big (64 free blocks: placed first) and d-small (32)."""
    p = cluster.worker("p0", "prefill")
    d_big = cluster.worker("d-big", "decode", num_blocks=64)
    d_small = cluster.worker("d-small", "decode", num_blocks=32)
    for w in (p, d_big, d_small):
        assert (await w.register()).accepted
    return p, d_big, d_small


async def test_reserve_failed_re_places_the_decode_and_reassigns_the_prefill(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster()
    p, d_big, d_small = await one_prefill_two_decoders(cluster)
    stub = cluster.inference
    stream = asyncio.create_task(collect(stub.Generate(greedy("re-place me", max_tokens=2), timeout=10)))
    req = (await d_big.expect("decode")).decode.request  # the one with the most free blocks first
    await d_big.send(
        reserve_failed=control_pb2.ReserveFailed(
            rid=req.rid,
            generation=req.generation,
            decode_worker_id="d-big",
            needed_blocks=2,
            available_blocks=0,
        )
    )
    again = (await d_small.expect("decode")).decode
    assert again.request.rid == req.rid and again.request.generation == req.generation
    assert again.prefill.worker_id == "p0"
    reassign = (await p.expect("reassign")).reassign
    assert (reassign.rid, reassign.generation, reassign.decode.worker_id) == (
        req.rid,
        req.generation,
        "d-small",
    )
    await p.tokens(req.rid, req.generation, 0, [500], prefill_done=True)
    await d_big.tokens(req.rid, req.generation, 1, [666])  # not the decode owner any more: dropped
    await d_small.tokens(req.rid, req.generation, 1, [501], finish=LENGTH)
    responses = await stream
    assert [i for r in responses if r.HasField("delta") for i in r.delta.token_ids] == [500, 501]


@pytest.mark.parametrize("first_token_from", FIRST_TOKEN_FROM)
async def test_a_re_placed_decode_reserves_for_what_prefill_computes_not_for_streamed_tokens(
    start_cluster: StartCluster, first_token_from: str
) -> None:
    """Token 1 is the request's before D refuses (streamed at once under `--first-token-from
    prefill`, held for the next D under `decode`): the new D still gets the sequence P computes (no
    output tokens), else its reservation would not match P's KV; under `decode` its first step
    streams token 1."""
    cluster = await start_cluster(routing=RoutingPolicy(first_token_from=first_token_from))
    p, d_big, d_small = await one_prefill_two_decoders(cluster)
    call = cluster.inference.Generate(greedy("token one first", max_tokens=3), timeout=10)
    req = (await d_big.expect("decode")).decode.request
    await p.tokens(req.rid, req.generation, 0, [500], prefill_done=True)
    first = asyncio.ensure_future(call.read())
    if first_token_from == "prefill":
        assert list((await first).delta.token_ids) == [500]  # the coordinator has streamed token 1
    failed = control_pb2.ReserveFailed(
        rid=req.rid, generation=req.generation, decode_worker_id="d-big", needed_blocks=2, available_blocks=0
    )
    await d_big.send(reserve_failed=failed)
    again = (await d_small.expect("decode")).decode.request
    assert again == req
    if first_token_from == "decode":
        await d_small.tokens(req.rid, req.generation, 0, [500])
        assert list((await first).delta.token_ids) == [500]
    call.cancel()


async def test_preempted_request_resumes_through_prefill_and_the_stream_continues(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster()
    p, d = await cluster.ready_pair()
    stub = cluster.inference
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
    admin = cluster.admin
    async with asyncio.timeout(5):
        while (await admin.GetPoolState(serving_pb2.GetPoolStateRequest())).workers[1].pool.free_blocks:
            await asyncio.sleep(0.01)
    stub = cluster.inference
    waiting = asyncio.create_task(collect(stub.Generate(greedy("first", max_tokens=1), timeout=10)))
    async with asyncio.timeout(5):
        while (await admin.GetPoolState(serving_pb2.GetPoolStateRequest())).queued_requests < 1:
            await asyncio.sleep(0.01)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await collect(stub.Generate(greedy("second", max_tokens=1), timeout=10))
    err = caught.value
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue is full" in (err.details() or "")
    status = rpc_status.from_call(err)
    assert status is not None
    info, retry = error_details_pb2.ErrorInfo(), error_details_pb2.RetryInfo()
    assert status.details[0].Unpack(info) and info.reason == "QUEUE_FULL"
    assert any(d.Unpack(retry) for d in status.details) and retry.retry_delay.ToNanoseconds() > 0
    # capacity comes back: the queued request is placed and completes
    await d.heartbeat(free_blocks=64)
    req = (await p.expect("prefill")).prefill.request
    await p.tokens(req.rid, req.generation, 0, [700], finish=LENGTH, prefill_done=True)
    assert (await waiting)[-1].finished.reason == LENGTH


async def test_a_stop_string_found_late_aborts_the_decode_work(start_cluster: StartCluster) -> None:
    cluster = await start_cluster()
    p, d = await cluster.ready_pair()
    stub = cluster.inference
    ids = cluster.model.tokenizer.encode(" the device is blinking amber", add_special_tokens=False)
    request = greedy("why?", max_tokens=16)
    request.stopping.stop.append(" is bl")
    stream = asyncio.create_task(collect(stub.Generate(request, timeout=10)))
    req = (await p.expect("prefill")).prefill.request
    await p.tokens(req.rid, req.generation, 0, ids[:1], prefill_done=True)
    await d.tokens(req.rid, req.generation, 1, ids[1:])  # the worker cannot see text: it goes on
    abort = (await d.expect("abort")).abort
    assert abort.reason == control_pb2.ABORT_REASON_STOP_STRING and abort.generation == req.generation + 1
    responses = await stream
    assert "".join(r.delta.text for r in responses if r.HasField("delta")) == " the device"
    finished = responses[-1].finished
    assert finished.reason == serving_pb2.FINISH_REASON_STOP_STRING and finished.stop_string == " is bl"


async def test_abort_rpc_finishes_the_stream_as_aborted(start_cluster: StartCluster) -> None:
    cluster = await start_cluster()
    p, d = await cluster.ready_pair()
    stub = cluster.inference
    call = stub.Generate(greedy("abort me", request_id="job-7"), timeout=10)
    req = (await p.expect("prefill")).prefill.request
    await p.tokens(req.rid, req.generation, 0, [800], prefill_done=True)
    await d.tokens(req.rid, req.generation, 0, [800])  # D's first step: token 1 streams (the default)
    assert list((await call.read()).delta.token_ids) == [800]
    with pytest.raises(grpc.aio.AioRpcError) as duplicate:  # the same id while it is in flight
        await collect(stub.Generate(greedy("again", request_id="job-7"), timeout=10))
    assert duplicate.value.code() == grpc.StatusCode.ALREADY_EXISTS
    await stub.Abort(serving_pb2.AbortRequest(request_id="job-7"))
    rest = await collect(call)
    assert rest[-1].finished.reason == serving_pb2.FINISH_REASON_ABORTED
    assert rest[-1].finished.usage.completion_tokens == 1
    for worker in (p, d):
        assert (await worker.expect("abort")).abort.reason == control_pb2.ABORT_REASON_ABORT_RPC
    with pytest.raises(grpc.aio.AioRpcError) as missing:
        await stub.Abort(serving_pb2.AbortRequest(request_id="job-7"))
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND


async def test_colocated_worker_serves_prefill_and_decode(start_cluster: StartCluster) -> None:
    cluster = await start_cluster()
    c = cluster.worker("c0", "colocated")
    assert (await c.register()).accepted
    stub = cluster.inference
    stream = asyncio.create_task(collect(stub.Generate(greedy("both", max_tokens=2), timeout=10)))
    decode = (await c.expect("decode")).decode
    assert not decode.HasField("prefill")
    req = decode.request
    await c.tokens(req.rid, req.generation, 0, [900], prefill_done=True)
    await c.tokens(req.rid, req.generation, 1, [901], finish=EOS)
    responses = await stream
    assert [i for r in responses if r.HasField("delta") for i in r.delta.token_ids] == [900, 901]
    assert responses[-1].finished.reason == EOS


async def test_fresh_pool_state_queries_every_worker(start_cluster: StartCluster) -> None:
    cluster = await start_cluster()
    p, d = await cluster.ready_pair()
    admin = cluster.admin
    call = admin.GetPoolState(serving_pb2.GetPoolStateRequest(fresh=True), timeout=5)
    query = (await p.expect("pool_state_query")).pool_state_query
    assert query.check_integrity
    pool = serving_pb2.KvPoolState(
        total_blocks=64, block_size=16, free_blocks=60, cached_blocks=4, integrity_ok=True
    )
    await p.send(
        pool_state_reply=control_pb2.PoolStateReply(query_id=query.query_id, worker_id="p0", pool=pool)
    )
    d_query = (await d.expect("pool_state_query")).pool_state_query
    bad = serving_pb2.KvPoolState(total_blocks=64, free_blocks=63, integrity_ok=False, integrity_error="leak")
    await d.send(
        pool_state_reply=control_pb2.PoolStateReply(query_id=d_query.query_id, worker_id="d0", pool=bad)
    )
    state = await call
    by_id = {w.worker_id: w for w in state.workers}
    assert [w.worker_id for w in state.workers] == ["p0", "d0"]  # sorted by role, then id
    assert by_id["p0"].pool.integrity_ok and by_id["p0"].pool.cached_blocks == 4
    assert by_id["d0"].pool.HasField("integrity_ok") and by_id["d0"].pool.integrity_error == "leak"
    assert by_id["d0"].health == serving_pb2.WORKER_HEALTH_READY
    # a worker that does not answer keeps its heartbeat numbers, integrity unknown; the call still returns
    await d.heartbeat(free_blocks=50)
    state = await admin.GetPoolState(serving_pb2.GetPoolStateRequest(fresh=True), timeout=1.0)
    silent = {w.worker_id: w for w in state.workers}["p0"]
    assert not silent.pool.HasField("integrity_ok")


async def test_rejections_reach_the_client_as_status_codes(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(max_request_bytes=1000, api_keys=("key",))
    stub = cluster.inference
    key = [("authorization", "Bearer key")]
    cases = [
        (greedy("hi"), [], grpc.StatusCode.UNAUTHENTICATED),
        (greedy(""), key, grpc.StatusCode.INVALID_ARGUMENT),
        (greedy("x" * 2000), key, grpc.StatusCode.INVALID_ARGUMENT),  # over the request byte limit
        (greedy("x" * 5000), key, grpc.StatusCode.RESOURCE_EXHAUSTED),  # over gRPC's own receive limit
        (greedy("hi"), key, grpc.StatusCode.UNAVAILABLE),  # admitted, but no worker is registered yet
    ]
    for request, metadata, code in cases:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await collect(stub.Generate(request, metadata=metadata, timeout=10))
        assert caught.value.code() == code, caught.value.details()
    tokenized = await stub.Tokenize(serving_pb2.TokenizeRequest(text="hello world"), metadata=key)
    assert list(tokenized.token_ids) == cluster.model.tokenizer.encode("hello world")
    text = await stub.Detokenize(serving_pb2.DetokenizeRequest(token_ids=tokenized.token_ids), metadata=key)
    assert text.text == "hello world"


async def test_drain_stops_admitting_and_aborts_what_outlives_the_timeout(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster()
    p, d = await cluster.ready_pair()
    stub = cluster.inference
    finishing = asyncio.create_task(collect(stub.Generate(greedy("finishes", max_tokens=1), timeout=10)))
    first = (await p.expect("prefill")).prefill.request
    stuck = asyncio.create_task(collect(stub.Generate(greedy("never finishes"), timeout=10)))
    second = (await p.expect("prefill")).prefill.request
    drain = asyncio.create_task(cluster.app.drain(timeout_s=1.0))
    health = health_pb2_grpc.HealthStub(cluster.channel)
    watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
    async with asyncio.timeout(5):
        while (await watch.read()).status != NOT_SERVING:
            pass
    watch.cancel()
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await collect(stub.Generate(greedy("too late"), timeout=10))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    await p.tokens(first.rid, first.generation, 0, [1000], finish=LENGTH, prefill_done=True)
    assert (await finishing)[-1].finished.reason == LENGTH  # in-flight work finishes during the drain
    await drain
    with pytest.raises(grpc.aio.AioRpcError) as aborted:
        await stuck
    assert aborted.value.code() == grpc.StatusCode.UNAVAILABLE and "shut down" in (
        aborted.value.details() or ""
    )
    abort = (await d.expect("abort")).abort
    assert (abort.rid, abort.reason) == (second.rid, control_pb2.ABORT_REASON_SHUTDOWN)


async def test_a_silent_decode_worker_goes_stale_and_its_request_resumes_elsewhere(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(heartbeat_timeout_ms=400)
    p, d_silent = await cluster.ready_pair(num_blocks=64)
    d_alive = cluster.worker("d1", "decode", num_blocks=32)
    assert (await d_alive.register()).accepted

    async def keep_alive() -> None:  # the live workers' heartbeat timers
        while True:
            await p.heartbeat()
            await d_alive.heartbeat()
            await asyncio.sleep(0.1)

    beats = asyncio.create_task(keep_alive())
    try:
        stream = asyncio.create_task(
            collect(cluster.inference.Generate(greedy("x", max_tokens=2), timeout=10))
        )
        req = (await d_silent.expect("decode")).decode.request
        assert (await p.expect("prefill")).prefill.request == req
        await p.tokens(req.rid, req.generation, 0, [50], prefill_done=True)
        resumed = (await p.expect("prefill")).prefill.request  # after the staleness bound
        assert resumed.generation == req.generation + 1 and unpack_ids(resumed.output_token_ids) == [50]
        replaced = (await p.expect("abort")).abort
        assert (replaced.generation, replaced.reason) == (req.generation, control_pb2.ABORT_REASON_REPLACED)
        assert (await d_alive.expect("decode")).decode.request.generation == resumed.generation
        state = await cluster.admin.GetPoolState(serving_pb2.GetPoolStateRequest())
        health = {w.worker_id: w.health for w in state.workers}
        assert health == {"p0": serving_pb2.WORKER_HEALTH_READY, "d0": serving_pb2.WORKER_HEALTH_STALE,
                          "d1": serving_pb2.WORKER_HEALTH_READY}  # fmt: skip
        await p.tokens(req.rid, resumed.generation, 1, [51], finish=LENGTH, prefill_done=True)
        assert [i for r in await stream if r.HasField("delta") for i in r.delta.token_ids] == [50, 51]
    finally:
        beats.cancel()
