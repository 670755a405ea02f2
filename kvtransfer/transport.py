"""The transport interface: listen, connect once per peer, and move tagged regions of KV memory.

Ownership:
- a worker creates one `Transport` per process, `start()`s it on an address it advertises, and
  `close()`s it at shutdown;
- `connect(address, key)` returns the cached `Peer` for that address, connecting (and running the
  authenticated hello of kvtransfer.hello with the peer's transfer `key`) only the first time; peers
  that connect to us are cached the same way, keyed by the address they advertise, but only once they
  proved they hold our `key`, so either side may call `connect` for a pair and both get one peer;
- a `Peer` moves bytes two-sided: the receiver posts a tensor as receive buffer under a tag
  (`post_recv`), the sender sends a tensor under the same tag (`send`). A message whose tag has no
  posted receive is never written anywhere the receiver did not post.

Buffers are contiguous torch tensors (CPU or CUDA). The caller keeps a posted or sent tensor alive
and unmodified until the operation finished (`PostedRecv.wait()` returned / `send` returned).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Awaitable, Callable

import structlog
import torch

from kvtransfer import hello
from kvtransfer.hello import HelloChannel, HelloRefused
from kvtransfer.lanes import transport_label
from kvtransfer.layout import KVLayout
from splitserve.logs import RateLimitedLog

log = structlog.get_logger(__name__)

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
    """Listens, pairs with authenticated peers of the same `KVLayout`, and caches one `Peer` per
    remote address.

    `key` is this transport's transfer key (random unless given): whoever connects to us must prove
    it holds it, so it travels only over the authenticated control plane. Refused connections are
    counted in `refused` by reason (kvtransfer.hello.REFUSAL_REASONS) and reported to `on_refused`.
    """

    backend: str = ""
    max_pending_hellos: int = 64

    def __init__(self, layout: KVLayout, key: bytes | None = None) -> None:
        self.layout = layout
        self.key = key if key is not None else hello.new_key()
        if len(self.key) != hello.KEY_BYTES:
            raise ValueError(f"a transfer key has {hello.KEY_BYTES} bytes, got {len(self.key)}")
        self.address = ""
        self.refused: Counter[str] = Counter()
        self.on_refused: Callable[[str], None] = lambda reason: None
        self._refusals = RateLimitedLog("kv connection refused")
        self._pending_hellos = 0
        self._peers: dict[str, Peer] = {}
        self._connecting: dict[str, asyncio.Future[Peer]] = {}

    @abstractmethod
    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen on `host:port` (0: the OS picks) and return the advertised address `host:port`."""

    @abstractmethod
    async def _connect(self, address: str, key: bytes) -> Peer:
        """Open a connection to `address` and run the connecting side of the hello (`hello.connect`)."""

    @abstractmethod
    async def close(self) -> None:
        """Close every peer and stop listening."""

    async def connect(self, address: str, key: bytes) -> Peer:
        """The cached peer for `address`, connecting first if needed (a lost peer is replaced);
        `key` is the peer's transfer key, as its control-plane messages advertise it.

        Raises LayoutMismatch when the peer's layout differs, TransportError when it cannot connect
        or does not prove it holds `key`.
        """
        peer = self._peers.get(address)
        if peer is not None and not peer.lost:
            return peer
        # Concurrent callers for one address share one connection attempt.
        pending = self._connecting.get(address)
        if pending is None:
            pending = asyncio.ensure_future(self._connect(address, key))
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
        label = transport_label(peer.transports)
        log.info(
            "kv peer accepted",
            backend=self.backend,
            peer=peer.address,
            transports=peer.transports,
            transport=label,
        )

    # -- the hello exchange, identical for every backend -------------------------------------------

    async def _accept(self, channel: HelloChannel, timeout_s: float) -> str | None:
        """Accepting side of the hello, bounded by `timeout_s`: the authenticated peer's address, or
        None after a refusal (counted in `refused` by reason and logged rate-limited). The caller
        closes the connection on None and never reads or posts anything on it. At most
        `max_pending_hellos` run at once (more are refused as "busy"), so connections that never
        finish a hello cannot exhaust the process's sockets."""
        if self._pending_hellos >= self.max_pending_hellos:
            self._refuse("busy", f"{self._pending_hellos} hellos already in progress")
            return None
        self._pending_hellos += 1
        try:
            return await asyncio.wait_for(hello.accept(channel, self.layout, self.key), timeout_s)
        except HelloRefused as e:
            self._refuse(e.reason, str(e))
        except TimeoutError:
            self._refuse("timeout", f"no complete hello within {timeout_s} s")
        except (ConnectionError, OSError) as e:
            self._refuse("closed", repr(e))
        finally:
            self._pending_hellos -= 1
        return None

    def _refuse(self, reason: str, detail: str) -> None:
        self.refused[reason] += 1
        self.on_refused(reason)
        self._refusals(reason, backend=self.backend, detail=detail)

    async def _hello(self, channel: HelloChannel, key: bytes, timeout_s: float) -> None:
        """Connecting side of the hello, bounded by `timeout_s` (TimeoutError)."""
        await asyncio.wait_for(hello.connect(channel, self.layout, self.address, key), timeout_s)


def as_bytes(buf: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (no copy)."""
    if not buf.is_contiguous():
        raise ValueError("transport buffers must be contiguous")
    return buf.reshape(-1).view(torch.uint8)


def shut_down(sock: socket.socket, *busy: Awaitable[object]) -> asyncio.Task[None]:
    """End a lost peer's socket from any callback: shut it down now (a read waiting on it sees EOF, a
    write EPIPE) and close the fd only once `busy` (its reader, its writes) ended. Closing at once
    would free the fd under a pending `sock_recv`: the selector keeps watching the number, the next
    socket reuses it, and that socket's reads never wake (measured: the next connection's hello
    timed out). The returned task closes it; a peer's close() awaits it."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)

    async def close_after() -> None:
        await asyncio.gather(*busy, return_exceptions=True)
        sock.close()

    return asyncio.ensure_future(close_after())
