"""TCP backend: the same two-sided, receiver-posted contract over plain sockets (no UCX).

One socket per peer carries frames `<type:u8, tag:u64, nbytes:u64>` (payload after DATA only).
A rendezvous keeps the receiver in charge of its memory, as UCX's tag matching does:

    sender                              receiver
    RTS(tag, n)            ------->     remembered until a receive for tag is posted (no payload)
                           <-------     CTS(tag)            once posted (a posted receive is matched)
    DATA(tag, n) + bytes   ------->     read straight into the posted buffer
    WITHDRAWN(tag)         ------->     the sender abandoned its send: forget the RTS, or finish a
                                        matched receive as cancelled (no byte was written)

A receive can be cancelled until its CTS is sent; after that it completes with data or WITHDRAWN.
CUDA buffers are staged through host memory (this backend is the fallback for machines without UCX).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from kvtransfer.errors import PeerLost, TransportError
from kvtransfer.hello import HELLO_MAX_BYTES, HelloChannel, HelloRefused
from kvtransfer.lanes import transport_label
from kvtransfer.layout import KVLayout
from kvtransfer.transport import CLOSED_LOCALLY, Peer, PostedRecv, Transport, as_bytes, shut_down

log = structlog.get_logger(__name__)

_HEADER = struct.Struct("<BQQ")
_RTS, _CTS, _DATA, _WITHDRAWN = 1, 2, 3, 4
_LEN = struct.Struct("<I")
_SOCKET_BUFFER_BYTES = 4 << 20


def _host_view(buf: torch.Tensor) -> memoryview:
    return memoryview(as_bytes(buf).numpy().data).cast("B")


@dataclass
class _Recv:
    buf: torch.Tensor
    done: asyncio.Future[bool]
    matched: bool = False


class TcpPostedRecv(PostedRecv):
    def __init__(self, peer: TcpPeer, tag: int, recv: _Recv) -> None:
        self._peer, self._tag, self._recv = peer, tag, recv

    def cancel(self) -> None:
        if not self._recv.matched and not self._recv.done.done():
            self._peer._posted.pop(self._tag, None)
            self._recv.done.set_result(False)

    async def wait(self) -> bool:
        return await asyncio.shield(self._recv.done)


class TcpPeer(Peer):
    """One connected socket; created by `TcpTransport` on connect or accept."""

    def __init__(self, address: str, sock: socket.socket) -> None:
        super().__init__(address)
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._write_lock = asyncio.Lock()
        self._posted: dict[int, _Recv] = {}
        self._rts: dict[int, int] = {}  # tag -> nbytes announced before a receive was posted
        self._cts: dict[int, asyncio.Future[None]] = {}  # our sends waiting for the receiver
        self._closing: asyncio.Task[None] | None = None  # closes the socket once the peer is lost
        self._reader = asyncio.ensure_future(self._read_loop())

    @property
    def transports(self) -> str:
        return "tcp"

    async def _write(self, kind: int, tag: int, nbytes: int = 0, payload: torch.Tensor | None = None) -> None:
        async with self._write_lock:
            await self._loop.sock_sendall(self._sock, _HEADER.pack(kind, tag, nbytes))
            if payload is not None:
                host = payload.cpu() if payload.is_cuda else payload
                await self._loop.sock_sendall(self._sock, _host_view(host))

    async def _read_exactly(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            n = await self._loop.sock_recv_into(self._sock, view[got:])
            if n == 0:
                raise ConnectionError("connection closed by peer")
            got += n

    async def _read_loop(self) -> None:
        header = bytearray(_HEADER.size)
        try:
            while True:
                await self._read_exactly(memoryview(header))
                kind, tag, nbytes = _HEADER.unpack(header)
                if kind == _RTS:
                    if tag in self._posted:
                        self._match(tag, nbytes)
                    else:
                        self._rts[tag] = nbytes
                elif kind == _CTS:
                    waiter = self._cts.pop(tag, None)
                    if waiter is not None and not waiter.done():
                        waiter.set_result(None)
                elif kind == _DATA:
                    await self._receive_data(tag, nbytes)
                elif kind == _WITHDRAWN:
                    self._rts.pop(tag, None)
                    recv = self._posted.pop(tag, None)
                    if recv is not None and not recv.done.done():
                        recv.done.set_result(False)
                else:
                    raise ConnectionError(f"bad frame type {kind}")
        except (ConnectionError, OSError) as e:
            self._fail(str(e) or type(e).__name__)
        except asyncio.CancelledError:
            self._fail(CLOSED_LOCALLY)
            raise

    def _match(self, tag: int, nbytes: int) -> None:
        """Clear the sender of `tag` to send. The CTS is written by a task, never by the reader, so
        the reader keeps draining while our own large writes hold the socket."""
        recv = self._posted[tag]
        if nbytes != recv.buf.numel() * recv.buf.element_size():
            raise ConnectionError(f"message {tag:#x} has {nbytes} bytes, the posted receive a different size")
        recv.matched = True
        self._spawn(self._write(_CTS, tag))

    def _spawn(self, write: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(write)
        task.add_done_callback(self._check_task)

    async def _receive_data(self, tag: int, nbytes: int) -> None:
        recv = self._posted.get(tag)
        if recv is None or not recv.matched:
            raise ConnectionError(f"DATA for tag {tag:#x} that was never cleared to send")
        target = torch.empty(nbytes, dtype=torch.uint8) if recv.buf.is_cuda else recv.buf
        # Still posted while the payload streams in, so a connection lost midway fails it (`_fail`).
        await self._read_exactly(_host_view(target))
        del self._posted[tag]
        if recv.buf.is_cuda:
            as_bytes(recv.buf).copy_(target)
        recv.done.set_result(True)

    def _fail(self, reason: str) -> None:
        for recv in self._posted.values():
            if not recv.done.done():
                recv.done.set_exception(PeerLost(reason))
        for waiter in self._cts.values():
            if not waiter.done():
                waiter.set_exception(PeerLost(reason))
        self._posted.clear()
        self._cts.clear()
        self._closing = shut_down(self._sock, self._reader, self._writes_done())
        self._mark_lost(reason)

    async def _writes_done(self) -> None:
        async with self._write_lock:  # the write holding it ends (EPIPE once shut down)
            pass

    def post_recv(self, tag: int, buf: torch.Tensor) -> TcpPostedRecv:
        if self.lost:
            raise PeerLost(self.lost_reason or "peer lost")
        if tag in self._posted:
            raise TransportError(f"a receive for tag {tag:#x} is already posted")
        recv = _Recv(buf, self._loop.create_future())
        self._posted[tag] = recv
        nbytes = self._rts.pop(tag, None)
        if nbytes is not None:
            try:
                self._match(tag, nbytes)
            except ConnectionError as e:
                self._fail(str(e))
        return TcpPostedRecv(self, tag, recv)

    def _check_task(self, task: asyncio.Future[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self._fail(repr(task.exception()))

    async def send(self, tag: int, buf: torch.Tensor) -> None:
        if self.lost:
            raise PeerLost(self.lost_reason or "peer lost")
        nbytes = buf.numel() * buf.element_size()
        cleared: asyncio.Future[None] = self._loop.create_future()
        self._cts[tag] = cleared
        try:
            await self._write(_RTS, tag, nbytes)
            await cleared
        except asyncio.CancelledError:
            self._cts.pop(tag, None)
            if not self.lost:
                self._spawn(self._write(_WITHDRAWN, tag))
            raise
        except OSError as e:
            raise PeerLost(str(e)) from e
        # Once cleared, the payload goes out whole even if our caller gives up: the stream's framing
        # depends on it, and the receiver's buffer is reserved for it.
        write = asyncio.ensure_future(self._write(_DATA, tag, nbytes, buf))
        try:
            await asyncio.shield(write)
        except OSError as e:
            raise PeerLost(str(e)) from e

    async def close(self) -> None:
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        if self._closing is not None:
            await self._closing


class TcpTransport(Transport):
    """The TCP fallback backend."""

    backend = "tcp"

    def __init__(self, layout: KVLayout, key: bytes | None = None, connect_timeout_s: float = 10.0) -> None:
        super().__init__(layout, key)
        self.connect_timeout_s = connect_timeout_s
        self._server: socket.socket | None = None
        self._acceptor: asyncio.Task[None] | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        server = socket.create_server((host, port))
        server.setblocking(False)
        self._server = server
        self.address = f"{host}:{server.getsockname()[1]}"
        self._acceptor = asyncio.ensure_future(self._accept_loop())
        log.info("kv transport listening", backend=self.backend, address=self.address)
        return self.address

    @staticmethod
    def _tune(sock: socket.socket) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER_BYTES)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER_BYTES)

    async def _accept_loop(self) -> None:
        assert self._server is not None
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(self._server)
            except OSError as e:  # e.g. out of file descriptors: keep listening
                self._refusals("accept failed", backend=self.backend, detail=repr(e))
                await asyncio.sleep(0.1)  # backoff, not synchronization: EMFILE would spin the loop
                continue
            self._tune(sock)
            task = asyncio.ensure_future(self._handshake_accepted(sock))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _handshake_accepted(self, sock: socket.socket) -> None:
        address = await self._accept(_TcpHello(sock), self.connect_timeout_s)
        if address is None:
            sock.close()  # refused: no frame of this connection was or will be read
            return
        try:
            peer = await self._pair(address, sock, accepted=True)
        except (ConnectionError, OSError, TimeoutError) as e:
            sock.close()
            self._refuse("closed", f"pairing failed after the hello: {e!r}")
            return
        self._register_accepted(peer)

    async def _pair(self, address: str, sock: socket.socket, accepted: bool) -> Peer:
        """The peer on a socket whose hello succeeded, which we `accepted` or connected (a subclass
        may exchange more on it first, bounded by connect_timeout_s; ConnectionError/OSError/
        TimeoutError if that fails). Registered as soon as this returns, with no await between."""
        return TcpPeer(address, sock)

    async def _connect(self, address: str, key: bytes) -> Peer:
        host, port = address.rsplit(":", 1)
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._tune(sock)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, (host, int(port))), self.connect_timeout_s)
            await self._hello(_TcpHello(sock), key, self.connect_timeout_s)
            peer = await self._pair(address, sock, accepted=False)
        except (OSError, ConnectionError, TimeoutError) as e:
            sock.close()
            raise TransportError(f"cannot connect to {address}: {e!r}") from e
        except TransportError:
            sock.close()
            raise
        log.info(
            "kv peer connected",
            backend=self.backend,
            peer=address,
            transports=peer.transports,
            transport=transport_label(peer.transports),
        )
        return peer

    async def close(self) -> None:
        if self._acceptor is not None:
            self._acceptor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._acceptor
        if self._server is not None:
            self._server.close()
        for peer in list(self._peers.values()):
            await peer.close()
        self._peers.clear()


class _TcpHello(HelloChannel):
    """Hello messages on a socket: `<len:u32>` + bytes, at most HELLO_MAX_BYTES each."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._loop = asyncio.get_running_loop()

    async def send(self, data: bytes) -> None:
        await self._loop.sock_sendall(self._sock, _LEN.pack(len(data)) + data)

    async def recv(self) -> bytes:
        (size,) = _LEN.unpack(await self._read(_LEN.size))
        if size > HELLO_MAX_BYTES:
            raise HelloRefused("malformed", f"hello message of {size} bytes (at most {HELLO_MAX_BYTES})")
        return await self._read(size)

    async def _read(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = await self._loop.sock_recv(self._sock, n - len(out))
            if not chunk:
                raise ConnectionError("connection closed during hello")
            out += chunk
        return out
