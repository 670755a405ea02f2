"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right HTTP code.

The HTTP door raises no errors of its own kind: every rejection is the `RpcError` that admission, the
request table and the dispatcher raise for gRPC too, and `STATUS_TABLE` below is the one place a gRPC
status becomes an HTTP status. `param` names the OpenAI field (`temperature`, not
`sampling.temperature`); `code` is the `ErrorReason` name in lower case (`queue_full`); a `RetryInfo`
becomes a `Retry-After` header (whole seconds, rounded up).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import grpc
from starlette.responses import JSONResponse

from coordinator.errors import RpcError

# gRPC status -> (HTTP status, OpenAI error type); a reason below overrides its status's row
STATUS_TABLE: Mapping[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.INTERNAL: (500, "server_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
REASON_TABLE: Mapping[str, tuple[int, str]] = {"REQUEST_TOO_LARGE": (413, "invalid_request_error")}
_FALLBACK = (500, "server_error")

# request path (as admission names it) -> OpenAI parameter; the rest keep their last path segment
_PARAMS = {"text": "prompt", "token_ids": "prompt", "token_ids.ids": "prompt", "request": None}
_PATH_PREFIX = re.compile(r"^(sampling|stopping|output|template)\.")


def http_status(err: RpcError) -> tuple[int, str]:
    """The HTTP status and OpenAI error type of `err`."""
    if err.reason is not None and err.reason in REASON_TABLE:
        return REASON_TABLE[err.reason]
    return STATUS_TABLE.get(err.code, _FALLBACK)


def openai_param(field: str | None, renames: Mapping[str, str] | None = None) -> str | None:
    """The OpenAI name of a request path: `sampling.top_p` -> `top_p`, `stopping.stop[2]` -> `stop[2]`."""
    if field is None:
        return None
    head = field.split("[", 1)[0]
    if renames and head in renames:
        return renames[head]
    if head in _PARAMS:
        return _PARAMS[head]
    return _PATH_PREFIX.sub("", field)


def error_response(
    status: int,
    kind: str,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(kind, message, param, code), status_code=status, headers=headers)


def error_body(kind: str, message: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def rpc_error_body(err: RpcError, renames: Mapping[str, str] | None = None) -> dict[str, Any]:
    _, kind = http_status(err)
    code = (err.reason or err.code.name).lower()
    return error_body(kind, err.message, openai_param(err.field, renames), code)


def rpc_error_response(err: RpcError, renames: Mapping[str, str] | None = None) -> JSONResponse:
    """`err` as the HTTP response a rejected call gets (Retry-After where the error carries RetryInfo)."""
    status, _ = http_status(err)
    headers = {}
    if err.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(err.retry_after_s)))
    return JSONResponse(rpc_error_body(err, renames), status_code=status, headers=headers)
