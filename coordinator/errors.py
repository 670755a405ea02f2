"""Rejections and failures as docs/api.md encodes them: a gRPC status code plus a `google.rpc.Status`.

Every non-OK status the coordinator itself produces is an `RpcError`: the status message says what to
fix, the details start with an `ErrorInfo` (domain "splitserve", reason = the `ErrorReason` name without
its prefix, metadata = the numbers involved), then a `BadRequest` naming each offending field and a
`RetryInfo` where a retry can help. Raised by admission, the request table and the dispatcher; turned
into the call's status by the servicers (`to_status`).

No status echoes unbounded client input: every message and metadata value is cut to a bounded prefix
here (`MAX_MESSAGE_CHARS`, `MAX_ECHO_CHARS`), and call sites quote client strings through `clip`.
"""

from __future__ import annotations

from collections.abc import Mapping

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from splitserve.v1 import serving_pb2

DOMAIN = "splitserve"
MAX_ECHO_CHARS = 64  # of one client-supplied value quoted in a message or metadata
MAX_MESSAGE_CHARS = 1024


def clip(value: object, limit: int = MAX_ECHO_CHARS) -> str:
    """`value` as text, cut to `limit` characters with a marker saying how long it was."""
    text = str(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}...({len(text)} chars)"


class RpcError(Exception):
    """A call that ends with `code`; `reason` is an `ErrorReason` name without `ERROR_REASON_`, or None
    for a status gRPC itself would give (DEADLINE_EXCEEDED), which carries no details."""

    def __init__(
        self,
        code: grpc.StatusCode,
        reason: str | None,
        message: str,
        *,
        field: str | None = None,
        metadata: Mapping[str, object] | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        if reason is not None:
            serving_pb2.ErrorReason.Value("ERROR_REASON_" + reason)  # ValueError on a typo
        message = clip(message, MAX_MESSAGE_CHARS)
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.field = field
        self.metadata = {k: clip(v) for k, v in (metadata or {}).items()}
        self.retry_after_s = retry_after_s

    def status_proto(self) -> status_pb2.Status:
        details: list[object] = []
        if self.reason is not None:
            details.append(
                error_details_pb2.ErrorInfo(reason=self.reason, domain=DOMAIN, metadata=self.metadata)
            )
        if self.field is not None:
            violation = error_details_pb2.BadRequest.FieldViolation(
                field=self.field, description=self.message
            )
            details.append(error_details_pb2.BadRequest(field_violations=[violation]))
        if self.retry_after_s is not None:
            delay = duration_pb2.Duration()
            delay.FromNanoseconds(int(self.retry_after_s * 1e9))
            details.append(error_details_pb2.RetryInfo(retry_delay=delay))
        status = status_pb2.Status(code=self.code.value[0], message=self.message)
        for detail in details:
            packed = any_pb2.Any()
            packed.Pack(detail)  # type: ignore[arg-type]
            status.details.append(packed)
        return status

    def to_status(self) -> grpc.Status:
        return rpc_status.to_status(self.status_proto())

    def __repr__(self) -> str:
        return f"RpcError({self.code.name}, {self.reason}, {self.message!r})"


def invalid(field: str, message: str, reason: str = "INVALID_PARAMETER", **metadata: object) -> RpcError:
    """INVALID_ARGUMENT naming `field` (a request path such as `sampling.temperature`)."""
    return RpcError(grpc.StatusCode.INVALID_ARGUMENT, reason, message, field=field, metadata=metadata)


def unavailable(reason: str, message: str, retry_after_s: float | None = None) -> RpcError:
    return RpcError(grpc.StatusCode.UNAVAILABLE, reason, message, retry_after_s=retry_after_s)


def empty_prompt(field: str, message: str) -> RpcError:
    return invalid(field, message, reason="EMPTY_PROMPT")
