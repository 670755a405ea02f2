"""The gRPC servicers: InferenceService, ModelService and AdminService over the coordinator's parts.

A Generate/Chat call: admission (ordered checks) -> `Dispatcher.submit` (duplicate id, queue) -> the
stream loop (`coordinator.request_stream`, shared with the HTTP door), which drains the record's events,
assembles deltas and ends with exactly one Finished or a non-OK status. If the call goes away first
(client cancel, deadline), the loop cancels the request: its generation is bumped and Abort goes to its
workers; the client is sent nothing more.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import grpc
import structlog

from coordinator.admission import Admission, AdmittedRequest
from coordinator.auth import Authenticator, bearer_from_metadata
from coordinator.control_loop import CoordinatorControl
from coordinator.dispatch import Dispatcher
from coordinator.errors import RpcError, clip, empty_prompt
from coordinator.metrics import CoordinatorMetrics
from coordinator.request_stream import stream_steps
from coordinator.request_table import EndEvent
from coordinator.workers import WorkerRegistry
from splitserve.v1 import control_pb2, serving_pb2, serving_pb2_grpc

log = structlog.get_logger(__name__)

Response = TypeVar("Response", serving_pb2.GenerateResponse, serving_pb2.ChatResponse)
AbortReason = control_pb2.AbortReason
# GetPoolState(fresh) answers this long before the call's deadline, and waits at most this long without one
_FRESH_MARGIN_S = 0.2
_FRESH_DEFAULT_S = 5.0


async def reject(
    context: grpc.aio.ServicerContext[Any, Any], err: RpcError, metrics: CoordinatorMetrics
) -> NoReturn:
    """End the call with `err`'s status and details (raises)."""
    metrics.rejections.labels(err.reason or err.code.name).inc()
    await context.abort_with_status(err.to_status())
    raise AssertionError("abort_with_status returned")  # pragma: no cover


class InferenceServicer(serving_pb2_grpc.InferenceServiceServicer):
    def __init__(self, admission: Admission, dispatcher: Dispatcher, metrics: CoordinatorMetrics) -> None:
        self.admission = admission
        self.dispatcher = dispatcher
        self.metrics = metrics

    async def Generate(
        self, request: serving_pb2.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[serving_pb2.GenerateResponse]:
        admit = self.admission.admit_generate(
            request, context.invocation_metadata(), context.time_remaining()
        )
        async for response in self._stream(admit, context, serving_pb2.GenerateResponse):
            yield response

    async def Chat(
        self, request: serving_pb2.ChatRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[serving_pb2.ChatResponse]:
        admit = self.admission.admit_chat(request, context.invocation_metadata(), context.time_remaining())
        async for response in self._stream(admit, context, serving_pb2.ChatResponse):
            yield response

    async def _stream(
        self,
        admit: Awaitable[AdmittedRequest],
        context: grpc.aio.ServicerContext[Any, Any],
        response: Callable[..., Response],
    ) -> AsyncIterator[Response]:
        try:
            record = self.dispatcher.submit(await admit)
        except RpcError as err:
            await reject(context, err, self.metrics)
        request_id = record.admitted.request_id
        steps = stream_steps(self.dispatcher, self.metrics, record, context.time_remaining)
        async with contextlib.aclosing(steps):
            async for step in steps:
                if step.delta is not None:
                    yield response(request_id=request_id, delta=step.delta)
                if step.error is not None:
                    await context.abort_with_status(step.error.to_status())
                if step.finished is not None:
                    yield response(request_id=request_id, finished=step.finished)

    async def Tokenize(
        self, request: serving_pb2.TokenizeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> serving_pb2.TokenizeResponse:
        try:
            self.admission.authenticate(context.invocation_metadata())
            self.admission.check_model(request.model)
            self.admission.check_size(request)
            if request.WhichOneof("input") == "chat":
                if not request.chat.messages:
                    raise empty_prompt("chat.messages", "chat.messages is empty: send at least one message")
                chat = await self.admission.tokenizer.render_chat(
                    request.chat.messages, request.template, context.time_remaining()
                )
                return serving_pb2.TokenizeResponse(token_ids=chat.token_ids, rendered_prompt=chat.text)
            if not request.text:
                raise empty_prompt("text", "nothing to tokenize: set a non-empty text or chat")
            add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
            ids = await self.admission.tokenizer.encode(request.text, add_special, context.time_remaining())
            return serving_pb2.TokenizeResponse(token_ids=ids)
        except RpcError as err:
            await reject(context, err, self.metrics)

    async def Detokenize(
        self, request: serving_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> serving_pb2.DetokenizeResponse:
        try:
            self.admission.authenticate(context.invocation_metadata())
            self.admission.check_model(request.model)
            self.admission.check_token_ids(request.token_ids, "token_ids")
        except RpcError as err:
            await reject(context, err, self.metrics)
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        text = await self.admission.tokenizer.decode(request.token_ids, skip_special_tokens=skip)
        return serving_pb2.DetokenizeResponse(text=text)

    async def Abort(
        self, request: serving_pb2.AbortRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> serving_pb2.AbortResponse:
        try:
            principal = self.admission.authenticate(context.invocation_metadata())
            # another principal's request is reported exactly like one that does not exist
            record = self.dispatcher.table.find(principal, request.request_id)
            if record is None:
                raise RpcError(
                    grpc.StatusCode.NOT_FOUND,
                    "REQUEST_NOT_FOUND",
                    f"no request with request_id {clip(request.request_id)!r} is in flight",
                    metadata={"request_id": request.request_id},
                )
        except RpcError as err:
            await reject(context, err, self.metrics)
        self.dispatcher.cancel(record, AbortReason.ABORT_REASON_ABORT_RPC, EndEvent(None))
        return serving_pb2.AbortResponse()


class ModelServicer(serving_pb2_grpc.ModelServiceServicer):
    def __init__(self, admission: Admission, registry: WorkerRegistry, metrics: CoordinatorMetrics) -> None:
        self.admission = admission
        self.registry = registry
        self.metrics = metrics

    def _model(self) -> serving_pb2.Model:
        prefill, decode = self.registry.ready_counts()
        return self.admission.model.to_proto(prefill, decode)

    async def ListModels(
        self, request: serving_pb2.ListModelsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> serving_pb2.ListModelsResponse:
        try:
            self.admission.authenticate(context.invocation_metadata())
        except RpcError as err:
            await reject(context, err, self.metrics)
        return serving_pb2.ListModelsResponse(models=[self._model()])

    async def GetModel(
        self, request: serving_pb2.GetModelRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> serving_pb2.Model:
        try:
            self.admission.authenticate(context.invocation_metadata())
            self.admission.check_model(request.name or "?")
        except RpcError as err:
            await reject(context, err, self.metrics)
        return self._model()


class AdminServicer(serving_pb2_grpc.AdminServiceServicer):
    """Operator introspection, the only service that shows worker addresses: admin key only
    (`Authenticator.authorize_admin`), disabled while no admin key is configured."""

    def __init__(self, auth: Authenticator, plane: CoordinatorControl, metrics: CoordinatorMetrics) -> None:
        self.auth = auth
        self.plane = plane
        self.metrics = metrics

    async def GetPoolState(
        self, request: serving_pb2.GetPoolStateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> serving_pb2.GetPoolStateResponse:
        try:
            self.auth.authorize_admin(bearer_from_metadata(context.invocation_metadata()))
        except RpcError as err:
            await reject(context, err, self.metrics)
        replies: dict[str, control_pb2.PoolStateReply] = {}
        if request.fresh:
            remaining = context.time_remaining()
            budget = _FRESH_DEFAULT_S if remaining is None else max(remaining - _FRESH_MARGIN_S, 0.0)
            replies = await self.plane.query_pools(budget)
        now = time.monotonic()
        workers = []
        for info in sorted(self.plane.registry, key=lambda w: (w.role, w.worker_id)):
            status = info.status(now)
            if info.worker_id in replies:
                status.pool.CopyFrom(replies[info.worker_id].pool)
            workers.append(status)
        dispatcher = self.plane.dispatcher
        return serving_pb2.GetPoolStateResponse(
            workers=workers,
            active_requests=len(dispatcher.table),
            queued_requests=len(dispatcher.queue),
            late_outputs_dropped=dispatcher.table.late_outputs_dropped,
        )
