"""Errors raised by the bulk data plane. Every failure of a peer or a session is one of these."""

from __future__ import annotations


class TransportError(Exception):
    """A transfer could not be carried out (connection refused, bad message, closed transport)."""


class PeerLost(TransportError):
    """The peer died or its connection broke; every session with it ends."""


class LayoutMismatch(TransportError):
    """Two workers whose KV layouts differ tried to pair; `field` names the first differing field."""

    def __init__(self, field: str, ours: object, theirs: object) -> None:
        super().__init__(f"KV layout mismatch on {field!r}: ours={ours!r}, peer's={theirs!r}")
        self.field = field
        self.ours = ours
        self.theirs = theirs


class SessionAborted(TransportError):
    """A transfer session ended without completing; `reason` says why (abort, lease, peer lost)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
