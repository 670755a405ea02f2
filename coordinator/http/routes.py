"""The OpenAI-compatible routes over the coordinator's own admission, dispatcher and request table.

    POST /v1/chat/completions   -> Admission.admit_chat     (the same call the gRPC Chat RPC makes)
    POST /v1/completions        -> Admission.admit_generate (the same call the gRPC Generate RPC makes)
    GET  /v1/models[/{model}]   -> the served model (API key required, like ListModels)
    GET  /health                -> 200 while gRPC health says SERVING, else 503 (no key: a probe)

A generation call: API key (`credentials` -> `Admission.authenticate`) -> body, bounded by
max_request_bytes (413) -> OpenAI shape (`schema`) -> admission -> `Dispatcher.submit` -> the shared
stream loop (`request_stream.stream_steps`). Every rejection is the `RpcError` gRPC would get, sent
through `errors.rpc_error_response`. The client going away (a dropped connection, streaming or not)
cancels the request exactly like a gRPC cancel: bump, Abort to its workers. The optional
`X-Request-Timeout: <seconds>` header is the call's deadline (gRPC's call deadline): it reaches the
workers in the execution request, and when it passes the call ends with 504.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import grpc
import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from coordinator.admission import Admission, Metadata
from coordinator.auth import Principal
from coordinator.dispatch import Dispatcher
from coordinator.errors import RpcError, invalid
from coordinator.http.errors import error_response, rpc_error_body, rpc_error_response
from coordinator.http.render import Renderer
from coordinator.http.schema import OpenAIRequest, parse_chat, parse_completion
from coordinator.metrics import CoordinatorMetrics
from coordinator.output import StreamStep
from coordinator.request_stream import abandon, stream_steps
from coordinator.request_table import RequestRecord
from splitserve.v1 import serving_pb2

log = structlog.get_logger(__name__)

Remaining = Callable[[], float | None]
_HTTP_REASONS = {404: "route_not_found", 405: "method_not_allowed"}


def credentials(request: Request) -> Metadata:
    """The call's credentials as `Admission` reads gRPC metadata: the one place HTTP headers become
    auth input, so both doors accept exactly the same keys."""
    value = request.headers.get("authorization")
    return [] if value is None else [("authorization", value)]


class OpenAIRoutes:
    """Created by the coordinator app with its admission and dispatcher; `app` is the ASGI app."""

    def __init__(
        self,
        admission: Admission,
        dispatcher: Dispatcher,
        metrics: CoordinatorMetrics,
        serving: Callable[[], bool],
    ) -> None:
        self.admission = admission
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.serving = serving  # the coordinator's one health rule, shared with gRPC health
        self.created = int(time.time())
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/models", self.list_models, methods=["GET"]),
                Route("/v1/models/{model:path}", self.get_model, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
            ],
            exception_handlers={HTTPException: _http_exception, Exception: _internal_error},
        )

    def _authenticate(self, request: Request) -> tuple[Metadata, Principal]:
        """The door's one API-key check (`Admission.authenticate`, as gRPC): the credentials and the
        caller they prove, which admission takes with the request. UNAUTHENTICATED before the body
        is read."""
        metadata = credentials(request)
        return metadata, self.admission.authenticate(metadata)

    # -- probes and models ---------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        serving = self.serving()
        return JSONResponse({"status": "serving" if serving else "not_serving"}, 200 if serving else 503)

    async def list_models(self, request: Request) -> Response:
        try:
            self._authenticate(request)
        except RpcError as err:
            return self._reject(err)
        return JSONResponse({"object": "list", "data": [self._model()]})

    async def get_model(self, request: Request) -> Response:
        try:
            self._authenticate(request)
            self.admission.check_model(request.path_params["model"])
        except RpcError as err:
            return self._reject(err)
        return JSONResponse(self._model())

    def _model(self) -> dict[str, Any]:
        model = self.admission.model
        return {
            "id": model.name,
            "object": "model",
            "created": self.created,
            "owned_by": "splitserve",
            "max_model_len": model.context_length,
        }

    # -- generation ----------------------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def _generate(self, request: Request, *, chat: bool) -> Response:
        parsed: OpenAIRequest | None = None
        try:
            metadata, principal = self._authenticate(request)
            remaining = _deadline(request)  # from arrival, like a gRPC deadline
            body = await self._body(request)
            request_id = request.headers.get("x-request-id", "")
            parsed = parse_chat(body, request_id) if chat else parse_completion(body, request_id)
            if isinstance(parsed.message, serving_pb2.ChatRequest):
                admitted = await self.admission.admit_chat(parsed.message, metadata, remaining(), principal)
            else:
                admitted = await self.admission.admit_generate(
                    parsed.message, metadata, remaining(), principal
                )
            record = self.dispatcher.submit(admitted)
        except RpcError as err:
            return self._reject(err, parsed)
        renderer = Renderer(
            chat=chat,
            request_id=admitted.request_id,
            model=admitted.model.name,
            tokenizer=self.admission.tokenizer,
            logprobs=parsed.logprobs,
            include_usage=parsed.include_usage,
        )
        headers = {"x-request-id": admitted.request_id}
        steps = stream_steps(self.dispatcher, self.metrics, record, remaining)
        if parsed.stream:
            sse = _sse(steps, renderer, parsed, remaining)
            return _GuardedStream(self._abandon(record, remaining), sse, headers=headers)
        try:
            return await self._whole(request, steps, renderer, parsed, remaining, headers)
        finally:
            self._abandon(record, remaining)()

    async def _whole(
        self,
        request: Request,
        steps: AsyncGenerator[StreamStep, None],
        renderer: Renderer,
        parsed: OpenAIRequest,
        remaining: Remaining,
        headers: dict[str, str],
    ) -> Response:
        """Collect the whole answer, or stop at once if the client disconnects first."""

        async def collect() -> Response:
            async with contextlib.aclosing(steps):
                try:
                    async for step in _bounded(steps, remaining):
                        await renderer.add(step)
                        if step.error is not None:  # failed after admission: not a rejection
                            return rpc_error_response(step.error, parsed.renames)
                except RpcError as err:  # the deadline
                    return rpc_error_response(err, parsed.renames)
            return JSONResponse(renderer.whole(), headers=headers)

        answer = asyncio.ensure_future(collect())
        gone = asyncio.ensure_future(_disconnected(request.receive))
        try:
            await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not answer.done():
                answer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            return await answer
        return Response(status_code=499)  # the client is gone; nobody reads this

    async def _body(self, request: Request) -> Any:
        """The JSON body, refused with 413 past max_request_bytes (before reading it when declared)."""
        limit = self.admission.max_request_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _too_large(int(declared), limit)
        size, chunks = 0, []
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit)
            chunks.append(chunk)
        try:
            return json.loads(b"".join(chunks))
        except ValueError as exc:
            raise invalid("body", f"the request body is not valid JSON: {exc}") from None

    def _abandon(self, record: RequestRecord, remaining: Remaining) -> Callable[[], None]:
        return lambda: abandon(self.dispatcher, self.metrics, record, remaining)

    def _reject(self, err: RpcError, parsed: OpenAIRequest | None = None) -> Response:
        """A call refused before admission passed (counted as a rejection, like gRPC's `reject`)."""
        self.metrics.rejections.labels(err.reason or err.code.name).inc()
        return rpc_error_response(err, parsed.renames if parsed else None)


async def _sse(
    steps: AsyncGenerator[StreamStep, None], renderer: Renderer, parsed: OpenAIRequest, remaining: Remaining
) -> AsyncIterator[bytes]:
    """Server-sent events: `data: {chunk}` per chunk, an error event if the request fails, else
    (usage chunk if asked) `data: [DONE]`."""
    async with contextlib.aclosing(steps):
        for chunk in renderer.start():
            yield _event(chunk)
        try:
            async for step in _bounded(steps, remaining):
                for chunk in await renderer.chunks(step):
                    yield _event(chunk)
                if step.error is not None:
                    yield _event(rpc_error_body(step.error, parsed.renames))
                    return
        except RpcError as err:
            yield _event(rpc_error_body(err, parsed.renames))
            return
        if parsed.include_usage:
            yield _event(renderer.usage_chunk())
        yield b"data: [DONE]\n\n"


class _GuardedStream(StreamingResponse):
    """A StreamingResponse that runs `on_close` however it ends: Starlette cancels the body on a client
    disconnect, possibly before the body generator ever started (and so before its own cleanup)."""

    def __init__(self, on_close: Callable[[], None], content: AsyncIterator[bytes], **kwargs: Any) -> None:
        super().__init__(content, media_type="text/event-stream", **kwargs)
        self.headers["cache-control"] = "no-cache"
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def _bounded(
    steps: AsyncGenerator[StreamStep, None], remaining: Remaining
) -> AsyncIterator[StreamStep]:
    """`steps`, ending with DEADLINE_EXCEEDED when the call's deadline passes between two steps."""
    while True:
        budget = remaining()
        try:
            step = await asyncio.wait_for(anext(steps), None if budget is None else max(budget, 0.0))
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, None, "the request's deadline passed") from None
        yield step


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _event(chunk: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(chunk, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def _deadline(request: Request) -> Remaining:
    """`X-Request-Timeout: <seconds>` as a time-remaining clock (None: no deadline)."""
    raw = request.headers.get("x-request-timeout")
    if raw is None:
        return lambda: None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise invalid(
            "x-request-timeout", f"X-Request-Timeout must be a positive number of seconds, got {raw!r}"
        )
    deadline = time.monotonic() + seconds
    return lambda: deadline - time.monotonic()


def _too_large(size: int, limit: int) -> RpcError:
    return invalid(
        "request",
        f"the request body is {size} bytes, over the server's limit of {limit}; send a shorter prompt",
        reason="REQUEST_TOO_LARGE",
        request_bytes=size,
        limit_bytes=limit,
    )


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    message = f"{request.method} {request.url.path}: {exc.detail}"
    code = _HTTP_REASONS.get(exc.status_code)
    return error_response(exc.status_code, kind, message, code=code, headers=exc.headers)


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.error("http handler failed", path=request.url.path, error=repr(exc))
    return error_response(500, "server_error", "internal error: see the coordinator's log", code="internal")
