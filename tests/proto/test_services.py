"""The public services have the methods issue 2 names, every definition is documented, and the
generated stubs and the documented error encoding work over a real gRPC channel."""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from google.protobuf import duration_pb2
from google.protobuf.message import Message
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from splitserve import protogen
from splitserve.v1 import serving_pb2, serving_pb2_grpc

# service -> method -> (request, response, server streaming)
EXPECTED_METHODS = {
    "InferenceService": {
        "Generate": ("GenerateRequest", "GenerateResponse", True),
        "Chat": ("ChatRequest", "ChatResponse", True),
        "Tokenize": ("TokenizeRequest", "TokenizeResponse", False),
        "Detokenize": ("DetokenizeRequest", "DetokenizeResponse", False),
        "Abort": ("AbortRequest", "AbortResponse", False),
    },
    "ModelService": {
        "ListModels": ("ListModelsRequest", "ListModelsResponse", False),
        "GetModel": ("GetModelRequest", "Model", False),
    },
    "AdminService": {"GetPoolState": ("GetPoolStateRequest", "GetPoolStateResponse", False)},
}


def test_services_have_the_named_methods() -> None:
    services = serving_pb2.DESCRIPTOR.services_by_name
    assert set(services) == set(EXPECTED_METHODS)
    for service, methods in EXPECTED_METHODS.items():
        found = {
            m.name: (m.input_type.name, m.output_type.name, m.server_streaming)
            for m in services[service].methods
        }
        assert found == methods, service
        assert not any(m.client_streaming for m in services[service].methods)


def test_sampling_and_stopping_knobs_distinguish_unset() -> None:
    for message in (serving_pb2.SamplingParams, serving_pb2.StoppingCriteria, serving_pb2.OutputOptions):
        singular = [f for f in message.DESCRIPTOR.fields if not f.is_repeated]
        assert singular and all(f.has_presence for f in singular), message.DESCRIPTOR.name
    params = serving_pb2.SamplingParams(temperature=0.0)
    assert params.HasField("temperature") and not params.HasField("top_p")


def test_generate_request_shape() -> None:
    fields = serving_pb2.GenerateRequest.DESCRIPTOR.fields_by_name
    assert [f.name for f in serving_pb2.GenerateRequest.DESCRIPTOR.oneofs_by_name["prompt"].fields] == [
        "text",
        "token_ids",
    ]
    assert fields["priority"].has_presence
    finished = serving_pb2.Finished.DESCRIPTOR.fields_by_name
    assert finished["usage"].message_type is serving_pb2.Usage.DESCRIPTOR
    assert finished["timings"].message_type is serving_pb2.Timings.DESCRIPTOR
    timings = {f.name for f in serving_pb2.Timings.DESCRIPTOR.fields}
    assert timings == {
        "queue_ms",
        "prefill_ms",
        "kv_transfer_ms",
        "first_token_ms",
        "decode_ms",
        "total_ms",
        "routing",
        "kv_transfer_in_ttft",
    }
    routing = serving_pb2.Timings.DESCRIPTOR.fields_by_name["routing"]
    assert routing.message_type is serving_pb2.RoutingDecision.DESCRIPTOR
    reasons = set(serving_pb2.FinishReason.keys())
    assert {"FINISH_REASON_EOS_TOKEN", "FINISH_REASON_LENGTH", "FINISH_REASON_ABORTED"} <= reasons


def test_every_definition_is_documented(tmp_path: Path) -> None:
    descriptors = protogen.compile_protos(protogen.REPO_ROOT, tmp_path)
    missing: list[str] = []
    for file in descriptors.file:
        if file.name not in protogen.PROTO_FILES:
            continue
        comments = {tuple(loc.path): loc.leading_comments.strip() for loc in file.source_code_info.location}

        def need(path: tuple[int, ...], name: str, comments: dict[tuple[int, ...], str] = comments) -> None:
            if not comments.get(path):
                missing.append(name)

        for i, msg in enumerate(file.message_type):
            need((4, i), msg.name)
            for j, field in enumerate(msg.field):
                need((4, i, 2, j), f"{msg.name}.{field.name}")
            for j, oneof in enumerate(msg.oneof_decl):
                if not oneof.name.startswith("_"):
                    need((4, i, 8, j), f"{msg.name}.{oneof.name} (oneof)")
        for i, enum in enumerate(file.enum_type):
            need((5, i), enum.name)
            for j, value in enumerate(enum.value):
                need((5, i, 2, j), value.name)
        for i, service in enumerate(file.service):
            need((6, i), service.name)
            for j, method in enumerate(service.method):
                need((6, i, 2, j), f"{service.name}.{method.name}")
    assert missing == []


def test_every_error_reason_has_a_documented_status_code() -> None:
    doc = (protogen.REPO_ROOT / "docs/api.md").read_text()
    table = dict(re.findall(r"^\| `([A-Z_]+)` \| `([A-Z_]+)` \|", doc, re.MULTILINE))
    reasons = [name.removeprefix("ERROR_REASON_") for name in serving_pb2.ErrorReason.keys()[1:]]
    assert sorted(table) == sorted(reasons)
    assert set(table.values()) <= set(grpc.StatusCode.__members__)


def error_status(
    code: grpc.StatusCode, reason: serving_pb2.ErrorReason.ValueType, message: str, retry_after_s: int = 0
) -> grpc.Status:
    """A rejection encoded as docs/api.md specifies (what the coordinator sends)."""
    reason_name = serving_pb2.ErrorReason.Name(reason).removeprefix("ERROR_REASON_")
    details: list[Message] = [error_details_pb2.ErrorInfo(reason=reason_name, domain="splitserve")]
    if retry_after_s:
        details.append(error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=retry_after_s)))
    status = status_pb2.Status(code=code.value[0], message=message)
    for detail in details:
        status.details.add().Pack(detail)
    return rpc_status.to_status(status)


class _Inference(serving_pb2_grpc.InferenceServiceServicer):
    """Only Generate is exercised; the other methods stay abstract."""

    def Generate(
        self, request: serving_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[serving_pb2.GenerateResponse]:
        if request.stopping.max_tokens > 2:
            context.abort_with_status(
                error_status(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    serving_pb2.ERROR_REASON_QUEUE_FULL,
                    "admission queue is full (64 waiting); retry later",
                    retry_after_s=2,
                )
            )
        delta = serving_pb2.Delta(text=request.text.upper(), token_ids=[1, 2], offset=0)
        yield serving_pb2.GenerateResponse(request_id=request.request_id, delta=delta)
        finished = serving_pb2.Finished(
            reason=serving_pb2.FINISH_REASON_LENGTH,
            usage=serving_pb2.Usage(prompt_tokens=1, completion_tokens=2),
        )
        yield serving_pb2.GenerateResponse(request_id=request.request_id, finished=finished)


@pytest.fixture
def stub() -> Iterator[serving_pb2_grpc.InferenceServiceStub]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    serving_pb2_grpc.add_InferenceServiceServicer_to_server(_Inference(), server)  # type: ignore[abstract]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield serving_pb2_grpc.InferenceServiceStub(channel)
    server.stop(grace=None)


def test_generated_stubs_stream_over_a_channel(stub: serving_pb2_grpc.InferenceServiceStub) -> None:
    request = serving_pb2.GenerateRequest(
        request_id="r1", text="hi", stopping=serving_pb2.StoppingCriteria(max_tokens=2)
    )
    events = [r.WhichOneof("event") for r in stub.Generate(request, timeout=10)]
    assert events == ["delta", "finished"]


def test_documented_error_details_reach_the_client(stub: serving_pb2_grpc.InferenceServiceStub) -> None:
    request = serving_pb2.GenerateRequest(text="hi", stopping=serving_pb2.StoppingCriteria(max_tokens=3))
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(request, timeout=10))
    err = caught.value
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    status = rpc_status.from_call(err)
    assert status is not None and status.code == code_pb2.RESOURCE_EXHAUSTED
    info, retry = error_details_pb2.ErrorInfo(), error_details_pb2.RetryInfo()
    assert status.details[0].Unpack(info) and status.details[1].Unpack(retry)
    assert (info.reason, info.domain, retry.retry_delay.seconds) == ("QUEUE_FULL", "splitserve", 2)
