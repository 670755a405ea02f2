"""kvtransfer: the bulk KV data plane (transport interface, UCX, TCP and NIXL backends, sessions, kvbench).

Start with `create_transport`, then `Transport.connect`, then a `RecvSession` / `SendSession` per
request. docs/kvtransfer.md has the design and the measured UCX settings.
"""

from __future__ import annotations

from kvtransfer.errors import LayoutMismatch, PeerLost, SessionAborted, TransportError
from kvtransfer.layout import KVLayout
from kvtransfer.nixl import NixlSettings, NixlTransport
from kvtransfer.plan import new_session_secret
from kvtransfer.session import RecvSession, SendSession, SessionConfig, SessionKey, SessionState
from kvtransfer.tcp import TcpTransport
from kvtransfer.transport import Peer, PostedRecv, Transport
from kvtransfer.ucx import UcxSettings, UcxTransport

BACKENDS = ("ucx", "tcp", "nixl")


def create_transport(
    backend: str,
    layout: KVLayout,
    ucx: UcxSettings | None = None,
    key: bytes | None = None,
    nixl: NixlSettings | None = None,
) -> Transport:
    """A not yet started transport of `backend` (one of BACKENDS) for workers of `layout`, whose
    transfer key is `key` (random if None; see `Transport.key`). "nixl" needs the `nixl` extra
    (its `start()` raises ImportError saying so)."""
    if backend == "ucx":
        return UcxTransport(layout, ucx, key)
    if backend == "tcp":
        return TcpTransport(layout, key)
    if backend == "nixl":
        return NixlTransport(layout, nixl, key)
    raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")


__all__ = [
    "BACKENDS",
    "KVLayout",
    "LayoutMismatch",
    "NixlSettings",
    "NixlTransport",
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
