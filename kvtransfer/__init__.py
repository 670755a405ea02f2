"""kvtransfer: the bulk KV data plane (transport interface, UCX and TCP backends, sessions, kvbench).

Start with `create_transport`, then `Transport.connect`, then a `RecvSession` / `SendSession` per
request. docs/kvtransfer.md has the design and the measured UCX settings.
"""

from __future__ import annotations

from kvtransfer.errors import LayoutMismatch, PeerLost, SessionAborted, TransportError
from kvtransfer.layout import KVLayout
from kvtransfer.plan import new_session_secret
from kvtransfer.session import RecvSession, SendSession, SessionConfig, SessionKey, SessionState
from kvtransfer.tcp import TcpTransport
from kvtransfer.transport import Peer, PostedRecv, Transport
from kvtransfer.ucx import UcxSettings, UcxTransport

BACKENDS = ("ucx", "tcp")


def create_transport(
    backend: str, layout: KVLayout, ucx: UcxSettings | None = None, key: bytes | None = None
) -> Transport:
    """A not yet started transport of `backend` ("ucx" or "tcp") for workers of `layout`, whose
    transfer key is `key` (random if None; see `Transport.key`)."""
    if backend == "ucx":
        return UcxTransport(layout, ucx, key)
    if backend == "tcp":
        return TcpTransport(layout, key)
    raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")


__all__ = [
    "BACKENDS",
    "KVLayout",
    "LayoutMismatch",
    "Peer",
    "PeerLost",
    "PostedRecv",
    "RecvSession",
    "SendSession",
    "SessionAborted",
    "SessionConfig",
    "SessionKey",
    "SessionState",
    "TcpTransport",
    "Transport",
    "TransportError",
    "UcxSettings",
    "UcxTransport",
    "create_transport",
    "new_session_secret",
]
