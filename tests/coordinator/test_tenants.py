"""Tenant isolation and AdminService over the real coordinator: requests belong to their API key, and
worker addresses are shown only to the admin key."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc
import pytest

from splitserve.v1 import serving_pb2, serving_pb2_grpc
from tests.coordinator.conftest import ADMIN_KEY, Cluster, WithMetadata
from tests.coordinator.test_integration import collect, greedy

StartCluster = Callable[..., Awaitable[Cluster]]
A, B = [("authorization", "Bearer key-a")], [("authorization", "Bearer key-b")]
ABORTED = serving_pb2.FINISH_REASON_ABORTED


async def abort_error(stub: serving_pb2_grpc.InferenceServiceStub, rid: str, md: object) -> tuple:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Abort(serving_pb2.AbortRequest(request_id=rid), metadata=md)
    err = caught.value
    return err.code(), err.details().replace(rid, "<id>"), len(err.trailing_metadata() or ())


async def test_key_b_can_neither_abort_nor_see_key_a_request_and_ids_are_per_key(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(api_keys=("key-a", "key-b"))
    p, d = await cluster.ready_pair()
    stub = cluster.inference
    call_a = stub.Generate(greedy("tenant a", request_id="job-1"), metadata=A, timeout=10)
    req_a = (await p.expect("prefill")).prefill.request
    await p.tokens(req_a.rid, req_a.generation, 0, [500], prefill_done=True)
    await d.tokens(req_a.rid, req_a.generation, 0, [500])  # D's first step: token 1 streams
    assert list((await call_a.read()).delta.token_ids) == [500]

    # B aborting A's id is answered exactly like an id nobody uses
    assert await abort_error(stub, "job-1", B) == await abort_error(stub, "never-used", B)
    assert (await abort_error(stub, "job-1", B))[0] == grpc.StatusCode.NOT_FOUND
    # B may use the same request_id: a second request, not ALREADY_EXISTS
    call_b = stub.Generate(greedy("tenant b", request_id="job-1"), metadata=B, timeout=10)
    req_b = (await p.expect("prefill")).prefill.request
    assert req_b.rid != req_a.rid
    await p.tokens(req_b.rid, req_b.generation, 0, [600], prefill_done=True)
    await d.tokens(req_b.rid, req_b.generation, 0, [600])
    assert list((await call_b.read()).delta.token_ids) == [600]

    await stub.Abort(serving_pb2.AbortRequest(request_id="job-1"), metadata=A)  # ends A's only
    assert (await collect(call_a))[-1].finished.reason == ABORTED
    await d.tokens(req_b.rid, req_b.generation, 1, [601], finish=serving_pb2.FINISH_REASON_LENGTH)
    rest_b = await collect(call_b)
    assert [i for r in rest_b if r.HasField("delta") for i in r.delta.token_ids] == [601]
    assert rest_b[-1].finished.reason == serving_pb2.FINISH_REASON_LENGTH


async def test_admin_service_refuses_inference_keys_and_is_disabled_without_an_admin_key(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(api_keys=("key-a",))
    await cluster.ready_pair()
    admin = serving_pb2_grpc.AdminServiceStub(cluster.channel)
    request = serving_pb2.GetPoolStateRequest()
    for metadata, code in (
        (A, grpc.StatusCode.PERMISSION_DENIED),
        ((), grpc.StatusCode.UNAUTHENTICATED),
        ([("authorization", "Bearer wrong")], grpc.StatusCode.UNAUTHENTICATED),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await admin.GetPoolState(request, metadata=metadata)
        assert caught.value.code() == code
    state = await cluster.admin.GetPoolState(request)  # the admin key
    assert {w.control_address for w in state.workers} == {"tcp://127.0.0.1:1/p0", "tcp://127.0.0.1:1/d0"}
    with pytest.raises(grpc.aio.AioRpcError) as caught:  # the admin key is no inference key
        await cluster.inference.Tokenize(
            serving_pb2.TokenizeRequest(text="x"), metadata=[("authorization", f"Bearer {ADMIN_KEY}")]
        )
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # ModelService shows no worker address
    models = serving_pb2_grpc.ModelServiceStub(cluster.channel)
    model = await models.GetModel(serving_pb2.GetModelRequest(name="tiny"), metadata=A)
    assert "127.0.0.1" not in str(model) and model.prefill_workers == model.decode_workers == 1

    disabled = await start_cluster(admin_keys=())
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await disabled.admin.GetPoolState(request)
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "--admin-key" in (caught.value.details() or "")


async def test_admin_service_on_its_own_listener_only(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(admin_port=0)
    assert cluster.app.admin_address and cluster.app.admin_address != cluster.app.grpc_address
    assert (await cluster.admin.GetPoolState(serving_pb2.GetPoolStateRequest())).active_requests == 0
    md = (("authorization", f"Bearer {ADMIN_KEY}"),)
    async with grpc.aio.insecure_channel(
        cluster.app.grpc_address, interceptors=[WithMetadata(md)]
    ) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await serving_pb2_grpc.AdminServiceStub(channel).GetPoolState(serving_pb2.GetPoolStateRequest())
        assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
