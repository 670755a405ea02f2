"""Servicer registration that treats request bytes as untrusted: the gRPC edge of every service.

The generated `add_*Servicer_to_server` functions hand grpcio `Message.FromString` as the request
deserializer; when it raises (bytes that are not a valid message: a bad tag, a truncated field, invalid
UTF-8 in a string), grpcio ends the call with UNKNOWN. `add_service` registers the same methods with a
deserializer that never raises: it returns a `Malformed` marker instead, and the method's wrapper ends
that call with INVALID_ARGUMENT MALFORMED_REQUEST before the servicer sees it. The wrapper also turns an
unexpected servicer exception (a bug) into INTERNAL with a logged traceback instead of UNKNOWN, and a
method the servicer leaves to its generated base class (health's List) into UNIMPLEMENTED.
Unary-unary and unary-stream methods are supported (all that serving.proto and health use).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, TypeAlias

import grpc
import structlog
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError, Message

from coordinator.errors import RpcError, clip
from coordinator.metrics import CoordinatorMetrics
from coordinator.server import reject

log = structlog.get_logger(__name__)
Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"


@dataclass(frozen=True, slots=True)
class Malformed:
    """What the deserializer returns for undecodable bytes (never reaches a servicer)."""

    message_type: str
    error: str
    size: int


def _decoder(cls: type[Message]) -> Callable[[bytes], Message | Malformed]:
    def decode(data: bytes) -> Message | Malformed:
        try:
            return cls.FromString(data)
        except (DecodeError, ValueError, RuntimeError) as exc:  # upb raises DecodeError; be generous
            return Malformed(cls.DESCRIPTOR.full_name, clip(exc, 120), len(data))

    return decode


def malformed_error(bad: Malformed) -> RpcError:
    return RpcError(
        grpc.StatusCode.INVALID_ARGUMENT,
        "MALFORMED_REQUEST",
        f"the request ({bad.size} bytes) is not a valid {bad.message_type} message: {bad.error}",
        metadata={"request_bytes": bad.size},
    )


class _Edge:
    """The wrappers of one server's methods: a malformed request or a servicer bug ends the call."""

    def __init__(self, metrics: CoordinatorMetrics) -> None:
        self.metrics = metrics

    async def failed(self, context: Context, method: str, exc: Exception) -> None:
        if isinstance(exc, NotImplementedError):  # a generated base-class method nobody overrides
            err = RpcError(grpc.StatusCode.UNIMPLEMENTED, None, f"{method} is not implemented by this server")
        else:
            log.exception("servicer raised", method=method)
            err = RpcError(grpc.StatusCode.INTERNAL, "INTERNAL", f"the server failed to handle {method}")
        await reject(context, err, self.metrics)

    def unary(self, method: str, impl: Callable[[Any, Context], Any]) -> Callable[[Any, Context], Any]:
        async def handle(request: Any, context: Context) -> Any:
            if isinstance(request, Malformed):
                await reject(context, malformed_error(request), self.metrics)
            try:
                return await impl(request, context)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await self.failed(context, method, exc)

        return handle

    def stream(
        self, method: str, impl: Callable[[Any, Context], AsyncIterator[Any]]
    ) -> Callable[[Any, Context], AsyncIterator[Any]]:
        async def handle(request: Any, context: Context) -> AsyncIterator[Any]:
            if isinstance(request, Malformed):
                await reject(context, malformed_error(request), self.metrics)
            try:
                async for response in impl(request, context):
                    yield response
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await self.failed(context, method, exc)

        return handle


def add_service(
    server: grpc.aio.Server,
    service: ServiceDescriptor,
    messages: ModuleType,
    servicer: object,
    metrics: CoordinatorMetrics,
) -> None:
    """Register `servicer`'s methods of `service` (message classes from the `messages` _pb2 module)."""
    edge = _Edge(metrics)
    handlers = {}
    for method in service.methods:
        request_cls = getattr(messages, method.input_type.name)
        response_cls = getattr(messages, method.output_type.name)
        impl = getattr(servicer, method.name)
        name = f"{service.name}.{method.name}"
        if method.client_streaming:
            raise ValueError(f"{name}: client-streaming methods are not supported here")
        if method.server_streaming:
            # an async generator yields its responses; a coroutine (health's Watch) writes them
            wrapped = edge.stream(name, impl) if inspect.isasyncgenfunction(impl) else edge.unary(name, impl)
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                wrapped,
                request_deserializer=_decoder(request_cls),
                response_serializer=response_cls.SerializeToString,
            )
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                edge.unary(name, impl),
                request_deserializer=_decoder(request_cls),
                response_serializer=response_cls.SerializeToString,
            )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
