"""The gRPC edge: undecodable request bytes are INVALID_ARGUMENT on every method, and no status echoes
more than a bounded prefix of what the client sent."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2

from splitserve.v1 import serving_pb2 as pb
from tests.coordinator.conftest import ADMIN_KEY, Cluster
from tests.coordinator.test_integration import collect, greedy

StartCluster = Callable[..., Awaitable[Cluster]]
# invalid for any message type: a truncated varint tag, a length-delimited field cut short
GARBAGE = (b"\xff\xff\xff", b"\x0a\x05ab")
BAD_UTF8_MODEL = b"\x0a\x02\xff\xfe"  # field 1 (`model`, a string) holding invalid UTF-8
SERVICES = [pb.DESCRIPTOR.services_by_name[n] for n in ("InferenceService", "ModelService", "AdminService")]
SERVICES.append(health_pb2.DESCRIPTOR.services_by_name["Health"])


def methods() -> list[tuple[str, bool]]:
    """(/package.Service/Method, server-streaming) of every method the coordinator registers."""
    return [(f"/{s.full_name}/{m.name}", m.server_streaming) for s in SERVICES for m in s.methods]


async def raw_call(channel: grpc.aio.Channel, path: str, streaming: bool, payload: bytes) -> grpc.StatusCode:
    """Send `payload` as the request bytes as-is (no serializer) and return the call's status code."""
    md = (("authorization", f"Bearer {ADMIN_KEY}"),)
    try:
        if streaming:
            call = channel.unary_stream(path)(payload, timeout=10, metadata=md)
            async for _ in call:
                pass
        else:
            await channel.unary_unary(path)(payload, timeout=10, metadata=md)
    except grpc.aio.AioRpcError as err:
        return err.code()
    return grpc.StatusCode.OK


async def test_raw_garbage_to_every_method_is_invalid_argument(start_cluster: StartCluster) -> None:
    cluster = await start_cluster()
    for path, streaming in methods():
        for payload in GARBAGE:
            code = await raw_call(cluster.channel, path, streaming, payload)
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (path, payload)
    for path in ("/splitserve.v1.InferenceService/Tokenize", "/splitserve.v1.InferenceService/Generate"):
        streaming = path.endswith("Generate")
        assert (
            await raw_call(cluster.channel, path, streaming, BAD_UTF8_MODEL)
            == grpc.StatusCode.INVALID_ARGUMENT
        )
    ok = await cluster.inference.Tokenize(pb.TokenizeRequest(text="still here"), timeout=10)
    assert list(ok.token_ids) == cluster.model.tokenizer.encode("still here")


async def test_errors_echo_only_a_bounded_prefix_of_client_input(start_cluster: StartCluster) -> None:
    cluster = await start_cluster()
    stub = cluster.inference
    huge = "r" * 100_000
    cases = [
        (stub.Abort(pb.AbortRequest(request_id=huge), timeout=10), grpc.StatusCode.NOT_FOUND),
        (collect(stub.Generate(greedy("hi", request_id=huge), timeout=10)), grpc.StatusCode.INVALID_ARGUMENT),
        (stub.Tokenize(pb.TokenizeRequest(model=huge, text="x"), timeout=10), grpc.StatusCode.NOT_FOUND),
    ]
    for call, code in cases:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call
        err = caught.value
        assert err.code() == code, err.details()
        assert len(err.details() or "") < 1200
        trailers = sum(len(v) for _, v in err.trailing_metadata() or ())
        assert trailers < 2000
