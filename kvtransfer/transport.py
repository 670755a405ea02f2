"""The transport interface: listen, connect once per peer, and move tagged regions of KV memory.

Ownership:
- a worker creates one `Transport` per process, `start()`s it on an address it advertises, and
  `close()`s it at shutdown;
- `connect(address)` returns the cached `Peer` for that address, connecting (and exchanging the
  layout digest) only the first time; peers that connect to us are cached the same way, keyed by the
  address they advertise, so either side may call `connect` for a pair and both get one peer;
- a `Peer` moves bytes two-sided: the receiver posts a tensor as receive buffer under a tag
  (`post_recv`), the sender sends a tensor under the same tag (`send`). A message whose tag has no
  posted receive is never written anywhere the receiver did not post.

Buffers are contiguous torch tensors (CPU or CUDA). The caller keeps a posted or sent tensor alive
and unmodified until the operation finished (`PostedRecv.wait()` returned / `send` returned).
"""

from __future__ import annotations

import asyncio
import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import structlog
import torch

from kvtransfer.errors import LayoutMismatch, TransportError
from kvtransfer.layout import KVLayout

log = structlog.get_logger(__name__)

PROTOCOL_VERSION = 1
CLOSED_LOCALLY = "closed locally"  # the lost reason of a peer this side closed (Peer.close)


class PostedRecv(ABC):
    """One posted receive. Created by `Peer.post_recv`; finished exactly once by data or cancel."""

    @abstractmethod
    def cancel(self) -> None:
        """Ask to withdraw the receive. A receive already matched still completes with its data."""

    @abstractmethod
    async def wait(self) -> bool:
        """True once the data landed; False once cancelled (no byte was or will be written).

        Raises PeerLost when the connection broke first (then no byte will be written either).
        """


class Peer(ABC):
    """A connected remote worker. Created and cached by the `Transport`; lives until it is lost."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.lost_reason: str | None = None
        self._lost_callbacks: list[Callable[[str], None]] = []

    @property
    def lost(self) -> bool:
        return self.lost_reason is not None

    @property
    @abstractmethod
    def transports(self) -> str:
        """What actually carries the bytes (e.g. UCX's selected transports), for logs and kvbench."""

    def on_lost(self, callback: Callable[[str], None]) -> Callable[[], None]:
        """Call `callback(reason)` once when the peer is lost (at once if already). Returns an unsubscriber."""
        if self.lost_reason is not None:
            callback(self.lost_reason)
            return lambda: None
        self._lost_callbacks.append(callback)
        return lambda: self._lost_callbacks.remove(callback) if callback in self._lost_callbacks else None

    def _mark_lost(self, reason: str) -> None:
        """Backends call this (on the event loop) when the connection broke."""
        if self.lost_reason is not None:
            return
        self.lost_reason = reason
        if reason == CLOSED_LOCALLY:  # our own close (drain, shutdown): nothing went wrong
            log.info("kv peer closed", peer=self.address)
        else:
            log.warning("kv peer lost", peer=self.address, reason=reason)
        callbacks, self._lost_callbacks = self._lost_callbacks, []
        for callback in callbacks:
            callback(reason)

    @abstractmethod
    def post_recv(self, tag: int, buf: torch.Tensor) -> PostedRecv:
        """Post `buf` (contiguous) as the receive buffer for the message tagged `tag`."""

    @abstractmethod
    async def send(self, tag: int, buf: torch.Tensor) -> None:
        """Send `buf` (contiguous) as the message tagged `tag`; returns once `buf` may be reused.

        Raises PeerLost if the connection broke. Cancelling the awaiting task abandons the send:
        if the receiver has not matched it yet, it never will (tags are never reused).
        """

    @abstractmethod
    async def close(self) -> None:
        """Close the connection; pending operations end with PeerLost."""


class Transport(ABC):
    """Listens, pairs with peers of the same `KVLayout`, and caches one `Peer` per remote address."""

    backend: str = ""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.address = ""
        self._peers: dict[str, Peer] = {}
        self._connecting: dict[str, asyncio.Future[Peer]] = {}

    @abstractmethod
    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen on `host:port` (0: the OS picks) and return the advertised address `host:port`."""

    @abstractmethod
    async def _connect(self, address: str) -> Peer:
        """Open a connection to `address` and run the hello exchange (see `hello` / `check_hello`)."""

    @abstractmethod
    async def close(self) -> None:
        """Close every peer and stop listening."""

    async def connect(self, address: str) -> Peer:
        """The cached peer for `address`, connecting first if needed (a lost peer is replaced).

        Raises LayoutMismatch when the peer's layout differs, TransportError when it cannot connect.
        """
        peer = self._peers.get(address)
        if peer is not None and not peer.lost:
            return peer
        # Concurrent callers for one address share one connection attempt.
        pending = self._connecting.get(address)
        if pending is None:
            pending = asyncio.ensure_future(self._connect(address))
            self._connecting[address] = pending
            pending.add_done_callback(lambda _: self._connecting.pop(address, None))
        peer = await asyncio.shield(pending)
        self._peers[address] = peer
        return peer

    def peer(self, address: str) -> Peer | None:
        """The cached peer for `address` (one that connected to us included), if any."""
        return self._peers.get(address)

    def _register_accepted(self, peer: Peer) -> None:
        if peer.address not in self._peers or self._peers[peer.address].lost:
            self._peers[peer.address] = peer
        log.info("kv peer accepted", backend=self.backend, peer=peer.address, transports=peer.transports)

    # -- the hello exchange, identical for every backend -------------------------------------------

    def hello(self) -> bytes:
        """What a connecting side sends first: our advertised address and layout."""
        return json.dumps(
            {"version": PROTOCOL_VERSION, "address": self.address, "layout": self.layout.to_dict()}
        ).encode()

    def check_hello(self, data: bytes) -> tuple[str, bool, bytes]:
        """Accepting side: (peer address, ok, reply). The reply says ok or names the mismatching field."""
        msg: dict[str, Any] = json.loads(data)
        reply: dict[str, Any] = {"ok": True, "address": self.address}
        try:
            if msg.get("version") != PROTOCOL_VERSION:
                raise LayoutMismatch("protocol version", PROTOCOL_VERSION, msg.get("version"))
            self.layout.check_compatible(KVLayout.from_dict(msg["layout"]))
        except LayoutMismatch as e:
            log.warning("kv pairing refused", peer=msg.get("address"), error=str(e))
            reply = {"ok": False, "field": e.field, "ours": e.ours, "theirs": e.theirs}
        return str(msg.get("address", "")), bool(reply["ok"]), json.dumps(reply).encode()

    @staticmethod
    def check_reply(data: bytes) -> None:
        """Connecting side: raise LayoutMismatch (from our point of view) if the peer refused."""
        reply = json.loads(data)
        if not reply.get("ok"):
            if "field" not in reply:
                raise TransportError(f"peer refused the connection: {reply}")
            raise LayoutMismatch(reply["field"], reply["theirs"], reply["ours"])


def as_bytes(buf: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (no copy)."""
    if not buf.is_contiguous():
        raise ValueError("transport buffers must be contiguous")
    return buf.reshape(-1).view(torch.uint8)
