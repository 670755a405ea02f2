"""UCX backend on UCXX: tag-matched two-sided transfers, receiver-posted buffers.

One `UcxTransport` per process (UCXX keeps one context per process): `start()` initialises UCXX with
`UcxSettings` on the running event loop and listens; `close()` stops it. Bulk messages use the
session tags verbatim (`force_tag`), so a receive posted on any endpoint matches by tag alone (tag
receives belong to the UCX worker): what keeps another process's messages out of a posted receive is
that session tags derive from a per-session secret (kvtransfer.plan). The hello exchange
(kvtransfer.hello) uses the endpoint's private tags.

Why the defaults are what they are is measured in docs/kvtransfer.md. In short: UCXX endpoints ask
for peer error handling (needed to survive a peer's death), which rules out UCX's shared-memory
transports unless `MM_ERROR_HANDLING=y` (without it every byte goes over TCP loopback) and its
single-copy CMA unless `CMA_MEMORY_INVALIDATE=y` (without it every byte is copied twice).

Cancelling one posted receive: UCX supports it (`ucp_request_cancel`) and UCXX implements it in
`ucxx::Request::cancel()`, but the Python binding does not expose it, so `_UcxLib.request_cancel`
calls the exported C++ method through ctypes. That needs requests submitted at once (no delayed
submission).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import re
import struct
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch

from kvtransfer.errors import PeerLost, TransportError
from kvtransfer.hello import HELLO_MAX_BYTES, HelloChannel, HelloRefused
from kvtransfer.lanes import transport_label
from kvtransfer.layout import KVLayout
from kvtransfer.transport import CLOSED_LOCALLY, Peer, PostedRecv, Transport, as_bytes
from kvtransfer.ucx_rma import RemoteKey, Rma

log = structlog.get_logger(__name__)

_LEN = struct.Struct("<I")
PROGRESS_MODES = ("hybrid", "thread", "thread-polling", "polling", "blocking")
UCXX_IDLE_WAIT_MS = 1  # the epoll timeout UCXX's thread mode starts its progress thread with

# Chosen by measurement (docs/kvtransfer.md, "UCX settings").
DEFAULT_UCX_OPTIONS: dict[str, str] = {
    # Shared memory despite peer error handling (else all bytes go over TCP loopback).
    "MM_ERROR_HANDLING": "y",
    # UCXX exports RNDV_FRAG_MEM_TYPE=cuda; host buffers pipeline through host fragments.
    "RNDV_FRAG_MEM_TYPE": "host",
    # Pipeline fragments that stay in a core's L2 (default 512k measured slower).
    "RNDV_FRAG_SIZE": "host:128k",
    # Single copy between processes on one host: with it, UCX moves rendezvous messages by CMA
    # (the receiver's `process_vm_readv` straight from the sender's buffer) under peer error
    # handling; without it, CMA is left out and every byte is copied twice through shared memory.
    # UCX's caveat ("invalidation not really supported") means a receiver may still read a send
    # buffer the sender gave up on: `UcxPeer.send` keeps such buffers alive until UCX is done, and
    # the session contract already lets only an aborted receiver read an abandoned send.
    "CMA_MEMORY_INVALIDATE": "y",
    # CMA copies in 4 MiB `process_vm_readv` calls, not 512 KiB: one-sided gets / NIXL medians at
    # 1-64 MiB 0.90-0.97 at 512k (8 rounds), 0.995-1.06 at 4m (18 rounds) (docs/kvtransfer.md,
    # "Posted in C, copied in 4 MiB calls").
    "CMA_SEG_SIZE": "4m",
}


@dataclass(frozen=True)
class UcxSettings:
    """How UCXX runs in this process.

    progress_mode: "hybrid" (UCXX's "thread" mode, plus the asyncio loop polling the worker while
    any send or posted receive of ours is outstanding: polling speed during transfers, no core spent
    while idle), or one of UCXX's modes: "thread" (a progress thread sleeping in epoll until UCX has
    work), "thread-polling" (that thread spins: one core always busy), "polling" (the asyncio loop
    spins, always), "blocking" (the asyncio loop wakes on UCX's fd).
    options: UCX configuration (names without the `UCX_` prefix), applied over DEFAULT_UCX_OPTIONS,
    or over nothing (UCX's and UCXX's stock configuration) when `tuned` is False.
    idle_wait_ms: the progress thread's epoll timeout (thread and hybrid modes), i.e. how often it
    wakes with nothing to do; UCX's own events (a message, a peer's hang-up, the RMA completion
    signal, a stop) wake it at once. UCXX's 1 ms wakes it 1,000 times a second: 2.4-2.8% of a core
    per idle process, and a decode step sharing the core ran 4-5% slower at the median beside such
    a waker (docs/kvtransfer.md, session 40). Stock settings (`tuned` False) keep UCXX's 1 ms.
    """

    progress_mode: str = "hybrid"
    options: dict[str, str] = field(default_factory=dict)
    tuned: bool = True
    connect_timeout_s: float = 10.0
    idle_wait_ms: int = 100

    def __post_init__(self) -> None:
        if self.progress_mode not in PROGRESS_MODES:
            raise ValueError(f"progress_mode must be one of {PROGRESS_MODES}, got {self.progress_mode!r}")
        if self.idle_wait_ms < 1:
            raise ValueError(f"idle_wait_ms must be >= 1, got {self.idle_wait_ms}")

    @property
    def progress_thread_wait_ms(self) -> int:
        """The progress thread's epoll timeout: `idle_wait_ms`, or UCXX's own under stock settings."""
        return self.idle_wait_ms if self.tuned else UCXX_IDLE_WAIT_MS

    def ucx_options(self) -> dict[str, str]:
        return {**(DEFAULT_UCX_OPTIONS if self.tuned else {}), **self.options}


def _ucx_array(buf: torch.Tensor) -> Any:
    from ucxx._lib.arr import Array

    flat = as_bytes(buf)
    return Array(flat if flat.is_cuda else flat.numpy())


class _UcxLib:
    """ctypes handles on UCXX/UCP symbols the Python binding does not expose."""

    def __init__(self) -> None:
        import libucx
        import libucxx

        ucxx_so = os.path.join(os.path.dirname(libucxx.__file__), "lib64", "libucxx.so")
        self.request_cancel = ctypes.CDLL(ucxx_so)._ZN4ucxx7Request6cancelEv
        self.request_cancel.argtypes = [ctypes.c_void_p]
        self.request_cancel.restype = None
        ucp_so = os.path.join(os.path.dirname(libucx.__file__), "lib", "libucp.so.0")
        self.ep_print_info = ctypes.CDLL(ucp_so).ucp_ep_print_info
        self.ep_print_info.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self.libc = ctypes.CDLL(None)
        self.libc.open_memstream.restype = ctypes.c_void_p
        self.libc.fclose.argtypes = [ctypes.c_void_p]
        self.libc.free.argtypes = [ctypes.c_void_p]

    def endpoint_lanes(self, ucp_ep: int) -> str:
        """The transports of each lane UCX selected for an endpoint, e.g. 'sysv/memory(am), tcp/lo(rma_bw)'."""
        buf, size = ctypes.c_void_p(), ctypes.c_size_t()
        stream = self.libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
        self.ep_print_info(ctypes.c_void_p(ucp_ep), ctypes.c_void_p(stream))
        self.libc.fclose(stream)
        text = ctypes.string_at(buf.value, size.value).decode(errors="replace") if buf.value else ""
        self.libc.free(buf)
        lanes = []
        for line in text.splitlines():
            m = re.search(r"lane\[\d+\]:\s+\d+:(\S+?)\.\d+\s.*?\bseg \d+\s*(.*)$", line)
            if m:
                lanes.append(f"{m.group(1)}({m.group(2).strip() or '-'})")
        return ", ".join(lanes) or "unknown"


class _Spinner:
    """Hybrid progress: the event loop polls the UCX worker while requests are outstanding, and
    UCXX's progress thread (asleep in epoll) takes over while none are. The spinner also completes
    the requests it tracks, checking a flag per request per turn, where UCXX's own `wait()` would
    park one polling task per request on the loop (hundreds of posted receives made every loop turn
    that many task switches long).

    Wait (shrink): the loop spins only while requests are outstanding (plus LINGER_S), instead of
    for the process's whole life as UCXX's "polling" mode does; and only one thread progresses at a
    time, so two processes on a 2-core machine do not fight four progressing threads for the cores.
    """

    LINGER_S = 0.01  # keep polling this long after the last request: back-to-back messages
    # would otherwise stop and restart the progress thread once each

    def __init__(self, enabled: bool, wait_ms: int) -> None:
        self.enabled = enabled
        self.wait_ms = wait_ms  # the progress thread's epoll timeout when it takes over again
        self.worker: Any = None
        self._pending: list[tuple[Any, asyncio.Future[None]]] = []
        self._task: asyncio.Task[None] | None = None
        self._idle_since = 0.0

    async def wait(self, request: Any) -> None:
        """Await a UCXX request; raises its error (UCXCanceledError, ...) like `request.wait()`."""
        if not self.enabled:
            await request.wait()
            return
        done = asyncio.get_running_loop().create_future()
        self._pending.append((request, done))
        if self._task is None:
            self.worker.stop_progress_thread()
            self._task = asyncio.ensure_future(self._spin())
        await done
        request.check_error()

    def _complete(self) -> None:
        pending = []
        for request, done in self._pending:
            if not request.completed:
                pending.append((request, done))
            elif not done.done():
                done.set_result(None)
        if self._pending and not pending:
            self._idle_since = time.monotonic()
        self._pending = pending

    async def _spin(self) -> None:
        try:
            while self._pending or time.monotonic() - self._idle_since < self.LINGER_S:
                while self.worker.progress_once():  # drain, as UCXX's worker.progress() does
                    pass
                self._complete()
                await asyncio.sleep(0)
        finally:
            self.worker.start_progress_thread(polling_mode=False, epoll_timeout=self.wait_ms)
            self._task = None


class UcxPostedRecv(PostedRecv):
    """A posted UCX tag receive; completion is watched from the moment it is posted."""

    def __init__(self, peer: UcxPeer, request: Any) -> None:
        self._peer = peer
        self._request = request
        self._cancel_requested = False
        self._done = asyncio.ensure_future(peer.spinner.wait(request))

    def cancel(self) -> None:
        if not self._cancel_requested:
            self._cancel_requested = True
            self.withdraw()

    def withdraw(self) -> None:
        """Cancel in UCX without asking: `wait()` then reports the peer lost (UcxPeer's use)."""
        self._peer.lib.request_cancel(ctypes.c_void_p(self._request.ucxx_ptr))

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        self._done.add_done_callback(lambda _: callback())

    async def wait(self) -> bool:
        from ucxx.exceptions import UCXCanceledError, UCXError

        try:
            await asyncio.shield(self._done)
        except UCXCanceledError:
            if self._cancel_requested:
                return False
            # Only our own cancel or the endpoint's close cancels a receive: the peer is gone.
            raise PeerLost(self._peer.lost_reason or "endpoint closed") from None
        except UCXError as e:
            raise PeerLost(f"receive failed: {e}") from e
        return True


class UcxPeer(Peer):
    """A UCXX endpoint to one remote worker; created by `UcxTransport` on connect or accept."""

    def __init__(
        self, address: str, endpoint: Any, lib: _UcxLib, loop: asyncio.AbstractEventLoop, spinner: _Spinner
    ) -> None:
        super().__init__(address)
        self.endpoint = endpoint
        self.lib = lib
        self.spinner = spinner
        self._transports = lib.endpoint_lanes(endpoint.ucp_endpoint)
        self._posted: set[UcxPostedRecv] = set()
        self._abandoned: list[tuple[Any, torch.Tensor]] = []  # (send request, its buffer)
        # UCXX calls this from its progress thread when the endpoint fails (peer died, link broke).
        endpoint.set_close_callback(self._on_close, cb_args=(loop,))

    def _on_close(self, loop: asyncio.AbstractEventLoop) -> None:
        if not loop.is_closed():
            loop.call_soon_threadsafe(self._mark_lost, "UCX endpoint closed or failed")

    def _mark_lost(self, reason: str) -> None:
        super()._mark_lost(reason)
        # Tag receives belong to the worker, not the endpoint: one posted after UCX failed the
        # endpoint but before this ran would wait forever. Withdraw every one still pending.
        for posted in list(self._posted):
            posted.withdraw()

    @property
    def transports(self) -> str:
        return f"ucx: {self._transports}"

    def _check_usable(self, failure: str) -> None:
        """Raise PeerLost if the peer is lost or UCX already failed its endpoint."""
        from ucxx.exceptions import UCXError

        if self.lost:
            raise PeerLost(self.lost_reason or "peer lost")
        try:
            self.endpoint._ep.raise_on_error()
        except UCXError as e:
            raise PeerLost(f"{failure}: {e}") from e

    def unpack_rkey(self, packed: bytes) -> RemoteKey:
        """The peer's packed remote key (kvtransfer.ucx_rma.MemRegion.rkey) usable on this
        endpoint; the caller destroys it (`close()`) before closing the peer."""
        self._check_usable("endpoint failed")
        return RemoteKey(self.endpoint.ucp_endpoint, packed)

    def post_recv(self, tag: int, buf: torch.Tensor) -> UcxPostedRecv:
        from ucxx.types import Tag, TagMaskFull

        self._check_usable("endpoint failed")
        # The public `Endpoint.recv`/`send` hide the request objects, which cancelling and the
        # spinner need; `_ep` is UCXX's low-level endpoint.
        posted = UcxPostedRecv(self, self.endpoint._ep.tag_recv(_ucx_array(buf), Tag(tag), TagMaskFull))
        self._posted.add(posted)
        posted.add_done_callback(lambda: self._posted.discard(posted))
        return posted

    async def send(self, tag: int, buf: torch.Tensor) -> None:
        from ucxx.exceptions import UCXError
        from ucxx.types import Tag

        self._check_usable("send failed")
        self._abandoned = [(r, b) for r, b in self._abandoned if not r.completed]
        try:
            request = self.endpoint._ep.tag_send(_ucx_array(buf), Tag(tag))
            try:
                await self.spinner.wait(request)
            except asyncio.CancelledError:
                # The caller gave up (a session abort), UCX has not: a receiver may still read
                # `buf` (CMA) or our progress copy it out. Keep it alive until UCX is done.
                self._abandoned.append((request, buf))
                raise
        except UCXError as e:
            raise PeerLost(f"send failed: {e}") from e

    async def close(self) -> None:
        await self.endpoint.close()
        self._mark_lost(CLOSED_LOCALLY)


class UcxTransport(Transport):
    """The UCX backend. One per process; see the module docstring."""

    backend = "ucx"

    def __init__(
        self, layout: KVLayout, settings: UcxSettings | None = None, key: bytes | None = None
    ) -> None:
        super().__init__(layout, key)
        self.settings = settings or UcxSettings()
        self._listener: Any = None
        self._lib: _UcxLib | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._spinner = _Spinner(
            self.settings.progress_mode == "hybrid", self.settings.progress_thread_wait_ms
        )
        self._rma: Rma | None = None

    @property
    def rma(self) -> Rma:
        """One-sided RMA on this transport's UCX context and worker (kvtransfer.ucx_rma), created
        on first use, on the event loop, after `start()`."""
        if self._rma is None:
            import ucxx

            if self._lib is None:
                raise TransportError("transport not started")
            ctx = ucxx.core._get_ctx()
            self._rma = Rma(ctx.context.handle, ctx.worker.handle)
        return self._rma

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        # UCXX exports UCX_MEMTYPE_CACHE, which this UCX no longer knows; keep stdout clean of that.
        os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
        import ucxx

        hybrid = self.settings.progress_mode == "hybrid"
        mode = "thread" if hybrid else self.settings.progress_mode
        ucxx.init(
            options=self.settings.ucx_options(),
            progress_mode=mode,
            enable_delayed_submission=False,
            # Python futures complete through a notifier thread that needs the GIL, which a spinning
            # loop holds for a whole switch interval: hybrid checks completion on the loop instead.
            enable_python_future=mode.startswith("thread") and not hybrid,
        )
        self._lib = _UcxLib()
        self._loop = asyncio.get_running_loop()
        # The worker object is not public in UCXX's async API; the spinner needs it to progress.
        worker = self._spinner.worker = ucxx.core._get_ctx().worker
        wait_ms = self.settings.progress_thread_wait_ms
        if mode == "thread" and wait_ms != UCXX_IDLE_WAIT_MS:
            # init started it (thread mode, for this loop) with UCXX's 1 ms; a stop signals the
            # worker, so the restart does not wait out a timeout
            worker.stop_progress_thread()
            worker.start_progress_thread(polling_mode=False, epoll_timeout=wait_ms)
        self._listener = ucxx.create_listener(
            self._on_accept, port=port, connect_timeout=self.settings.connect_timeout_s
        )
        self.address = f"{host}:{self._listener.port}"
        log.info("kv transport listening", backend="ucx", address=self.address, settings=self.settings)
        return self.address

    async def _on_accept(self, endpoint: Any) -> None:
        assert self._lib is not None and self._loop is not None
        channel = _UcxHello(endpoint)
        address = await self._accept(channel, self.settings.connect_timeout_s)
        if address is not None:
            self._register_accepted(UcxPeer(address, endpoint, self._lib, self._loop, self._spinner))
            return
        # Refused. Wait (bounded) for the peer to close after reading our refusal (closing first
        # could drop it), then close: until then an unauthenticated endpoint can send tagged
        # messages to this worker, which only match receives under session tags it cannot know.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(channel.recv(), self.settings.connect_timeout_s)
        await _close_quietly(endpoint)

    async def _connect(self, address: str, key: bytes) -> Peer:
        import ucxx
        from ucxx.exceptions import UCXError

        if self._lib is None or self._loop is None:
            raise TransportError("transport not started")
        host, port = address.rsplit(":", 1)
        timeout_s = self.settings.connect_timeout_s
        try:
            endpoint = await ucxx.create_endpoint(host, int(port), connect_timeout=timeout_s)
        except (UCXError, TimeoutError, OSError) as e:
            raise TransportError(f"cannot connect to {address}: {e!r}") from e
        try:
            await self._hello(_UcxHello(endpoint), key, timeout_s)
        except (ConnectionError, TimeoutError, OSError) as e:
            await _close_quietly(endpoint)
            raise TransportError(f"cannot connect to {address}: {e!r}") from e
        except TransportError:
            await _close_quietly(endpoint)
            raise
        peer = UcxPeer(address, endpoint, self._lib, self._loop, self._spinner)
        log.info(
            "kv peer connected",
            backend="ucx",
            peer=address,
            transports=peer.transports,
            transport=transport_label(peer.transports),
        )
        return peer

    async def close(self) -> None:
        import ucxx

        for peer in list(self._peers.values()):
            if not peer.lost:
                await peer.close()
        self._peers.clear()
        if self._rma is not None:  # after the endpoints: their close fails the gets still in flight
            await self._rma.close()
            self._rma = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            ucxx.stop_notifier_thread()


async def _close_quietly(endpoint: Any) -> None:
    with contextlib.suppress(Exception):  # already closed or failed: nothing more to release
        await endpoint.close()


class _UcxHello(HelloChannel):
    """Hello messages on an endpoint's private tags, each one frame of exactly HELLO_FRAME bytes
    (`<len:u32>` + message + padding): a receive never allocates what the peer asks for, and a
    larger message fails UCX's receive (truncated) instead of landing anywhere."""

    HELLO_FRAME = _LEN.size + HELLO_MAX_BYTES

    def __init__(self, endpoint: Any) -> None:
        self._endpoint = endpoint

    async def send(self, data: bytes) -> None:
        frame = bytearray(self.HELLO_FRAME)
        frame[: _LEN.size + len(data)] = _LEN.pack(len(data)) + data
        await self._call(self._endpoint.send(frame))

    async def recv(self) -> bytes:
        frame = bytearray(self.HELLO_FRAME)
        await self._call(self._endpoint.recv(frame))
        (size,) = _LEN.unpack_from(frame)
        if size > HELLO_MAX_BYTES:
            raise HelloRefused("malformed", f"hello message of {size} bytes (at most {HELLO_MAX_BYTES})")
        return bytes(frame[_LEN.size : _LEN.size + size])

    @staticmethod
    async def _call(operation: Coroutine[Any, Any, None]) -> None:
        from ucxx.exceptions import UCXError

        try:
            await operation
        except UCXError as e:  # truncated (too large), closed, or failed endpoint
            raise ConnectionError(f"UCX: {e!r}") from e
