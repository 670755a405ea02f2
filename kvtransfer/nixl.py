"""NIXL backend: the receiver pulls each message with a one-sided NIXL READ into the buffer it posted.

What it is for: NIXL (UCX underneath) is how vLLM, SGLang, Dynamo and llm-d move KV; this backend
speaks it behind the same `Transport` / `Peer` / `PostedRecv` contract as the UCX and TCP backends.
Not the default (docs/kvtransfer.md, "NIXL backend", has the numbers).

Each peer pair has one TCP socket (the TCP backend's listener and hello, kvtransfer.tcp) that carries
the authenticated hello, then NIXL's connection metadata, then small frames
`<type:u8, tag:u64, addr:u64, nbytes:u64, device:i32, payload:u32>`; bulk bytes move only by NIXL:

    sender                                  receiver (posted `buf` under tag)
    register buf's memory; RTS(tag, addr, n, device, NIXL metadata of the registration if new)  ---->
                                            READ remote (addr, n) -> buf, by NIXL, once posted
                                  <------   DONE(tag, taken=1) once the READ completed
    WITHDRAWN(tag) (the send was abandoned) ---->  forget the RTS, DONE(tag, taken=0); a READ already
                                            started completes first (then DONE(tag, 1))

Coalescing: frames queued in one event-loop turn leave in one write (a session's RTS for every
message of a chunk, the DONEs of one READ), and the receives matched in one turn (every RTS of a read
of the socket, or every receive a session posts at once) are read in one NIXL READ, one descriptor
pair per message, instead of one READ each.

So no byte lands anywhere the receiver did not post (the receiver initiates every write into its own
memory), a cancelled receive is never read into (its RTS is never matched), and a receive already
matched completes. The sender keeps an abandoned buffer registered and alive until that DONE.

Peer death: NIXL has no death callback; the control socket is the liveness channel. On one host a
killed process's socket is reset by the kernel at once, so PeerLost comes within a loop turn; across
hosts TCP keepalive (KEEPALIVE_S) bounds it. A failed READ also loses the peer. A READ in flight when
the peer is lost is cancelled (or waited out) before its receive fails, so nothing lands afterwards.

Registration (`NixlSettings.register`): "storage" registers a tensor's whole storage once (the KV
pool) and keeps it, an idle staging buffer's for up to nixl_memory.MAX_IDLE_REGIONS; "tensor"
registers each message's bytes for the operation only. Either way only authenticated peers get NIXL metadata. On one
host UCX reads by CMA, which no deregistration revokes (measured: a READ after deregistration still
succeeds): what keeps others out is the hello, as for the UCX backend.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
import uuid
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch

from kvtransfer.errors import PeerLost, TransportError
from kvtransfer.layout import KVLayout
from kvtransfer.nixl_memory import Reads, Region, Regions, import_nixl, metadata_agent
from kvtransfer.nixl_rma import NixlRemoteKey, NixlRma, mem_type, unpack_key
from kvtransfer.tcp import TcpTransport
from kvtransfer.transport import CLOSED_LOCALLY, Peer, PostedRecv, as_bytes, shut_down
from kvtransfer.ucx_rma import RmaError

log = structlog.get_logger(__name__)

_FRAME = struct.Struct("<BQQQiI")
_META, _RTS, _DONE, _WITHDRAWN = 1, 2, 3, 4
MAX_PAYLOAD = 64 << 10  # NIXL metadata of one registration is a few hundred bytes
# RTS frames the receiver holds for tags it has not posted (yet): a peer past this is broken (or
# hostile) and is dropped, rather than growing our memory frame by frame.
MAX_UNMATCHED_RTS = 4096
KEEPALIVE_S = 2  # idle seconds before TCP probes a silent peer (then 3 probes, 1 s apart)
REGISTER_MODES = ("storage", "tensor")


@dataclass(frozen=True)
class NixlSettings:
    """How the NIXL agent runs. progress_thread: NIXL's own progress thread (the sender's side of a
    READ progresses without its event loop). Off by default: NIXL's Python API starts it with no
    delay between progress rounds, so it spins a core for as long as the agent lives, transfers or
    not (two idle agents: 2 CPU-seconds a second, NIXL 1.5.1); without it our event loop progresses
    the agent only while a READ or a send of ours is in flight (`nixl_memory.Reads`).
    register: see the module docstring."""

    progress_thread: bool = False
    register: str = "storage"
    connect_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.register not in REGISTER_MODES:
            raise ValueError(f"register must be one of {REGISTER_MODES}, got {self.register!r}")


@dataclass(eq=False)
class _Read:
    """One NIXL READ: the posted receives (by tag) matched in one event-loop turn, read together."""

    handle: Any
    recvs: dict[int, _Recv]


@dataclass
class _Recv:
    buf: torch.Tensor
    done: asyncio.Future[bool]
    read: _Read | None = None  # the READ it is part of, once started
    region: Region | None = None


class NixlPostedRecv(PostedRecv):
    def __init__(self, peer: NixlPeer, tag: int, recv: _Recv) -> None:
        self._peer, self._tag, self._recv = peer, tag, recv

    def cancel(self) -> None:
        matched = self._recv.read is not None or self._tag in self._peer._matched
        if not matched and not self._recv.done.done():
            self._peer._posted.pop(self._tag, None)
            self._recv.done.set_result(False)

    async def wait(self) -> bool:
        return await asyncio.shield(self._recv.done)


@dataclass
class _Send:
    region: Region
    buf: torch.Tensor  # alive until the receiver said DONE
    taken: asyncio.Future[bool] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    abandoned: bool = False


class NixlPeer(Peer):
    """One authenticated control socket plus the remote NIXL agent `remote`; created by NixlTransport."""

    def __init__(self, address: str, sock: socket.socket, transport: NixlTransport, remote: str) -> None:
        super().__init__(address)
        self._sock, self._transport, self.remote = sock, transport, remote
        self._agent = transport.agent
        self._loop = asyncio.get_running_loop()
        self._out: list[bytes] = []  # frames queued for the writer, sent together
        self._writer: asyncio.Task[None] | None = None
        self._closing: asyncio.Task[None] | None = None  # closes the socket once the peer is lost
        self._posted: dict[int, _Recv] = {}
        self._rts: dict[int, tuple[int, int, int]] = {}  # tag -> (addr, nbytes, device) before posting
        self._matched: dict[int, tuple[int, int, int]] = {}  # posted and announced: read next turn
        self._sends: dict[int, _Send] = {}
        self._announced: set[int] = set()  # serials of the regions whose metadata the peer has
        self._backend = "UCX"
        self._reader = asyncio.ensure_future(self._read_loop())

    @property
    def transports(self) -> str:
        return f"nixl: {self._backend} READ (receiver-pulled)"

    # -- frames ------------------------------------------------------------------------------------

    def _write(
        self, kind: int, tag: int, addr: int = 0, nbytes: int = 0, device: int = -1, payload: bytes = b""
    ) -> asyncio.Task[None]:
        """Queue one frame; the returned writer task ends once it is on the socket. Frames queued in
        one event-loop turn (a session's RTS for every message it sends at once, the DONE of every
        receive one READ completed) leave in one `sendall`; a write error loses the peer."""
        self._out.append(_FRAME.pack(kind, tag, addr, nbytes, device, len(payload)) + payload)
        if self._writer is None or self._writer.done():
            self._writer = asyncio.ensure_future(self._drain())
            self._writer.add_done_callback(self._check_write)
        return self._writer

    async def _drain(self) -> None:
        while self._out:
            frames, self._out = self._out, []
            await self._loop.sock_sendall(self._sock, b"".join(frames))

    def _check_write(self, task: asyncio.Future[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self._fail(repr(task.exception()))

    async def _read_loop(self) -> None:
        reason = CLOSED_LOCALLY  # cancelled by close()
        try:
            while True:
                self._on_frame(*await read_frame(self._sock))
        except (ConnectionError, OSError) as e:
            reason = str(e) or type(e).__name__
        except asyncio.CancelledError:
            raise
        except Exception as e:  # NIXL refused the peer's metadata or descriptor: a broken peer
            reason = f"bad frame from peer: {e!r}"
        finally:
            self._fail(reason)

    def _on_frame(self, kind: int, tag: int, addr: int, nbytes: int, device: int, payload: bytes) -> None:
        if kind == _RTS:
            if payload:  # the sender's new registration, loaded only if it is the sender's own
                if (name := metadata_agent(payload)) != self.remote:
                    raise ConnectionError(
                        f"an RTS carried NIXL metadata of agent {name!r}, not of {self.remote!r}"
                    )
                self._agent.add_remote_agent(payload)
            if tag in self._posted:
                if self._posted[tag].read is not None or tag in self._matched:
                    # a second READ would land in the buffer after its receive completed
                    raise ConnectionError(f"a second RTS for message {tag:#x}, already being read")
                self._match(tag, (addr, nbytes, device))
            elif tag in self._rts or len(self._rts) < MAX_UNMATCHED_RTS:
                self._rts[tag] = (addr, nbytes, device)
            else:
                raise ConnectionError(f"over {MAX_UNMATCHED_RTS} announced messages nobody posted")
        elif kind == _DONE:
            self._on_done(tag, bool(addr))
        elif kind == _WITHDRAWN:
            if self._rts.pop(tag, None) is not None or tag not in self._posted:
                self._write(_DONE, tag, 0)
            # else: matched, its READ in flight or starting at the end of this turn: its
            # completion answers with DONE
        else:
            raise ConnectionError(f"bad frame type {kind}")

    # -- receiver side -----------------------------------------------------------------------------

    def post_recv(self, tag: int, buf: torch.Tensor) -> NixlPostedRecv:
        if self.lost:
            raise PeerLost(self.lost_reason or "peer lost")
        if tag in self._posted:
            raise TransportError(f"a receive for tag {tag:#x} is already posted")
        as_bytes(buf)  # contiguous, or ValueError before anything is posted
        recv = self._posted[tag] = _Recv(buf, self._loop.create_future())
        if tag in self._rts:  # the sender was first
            self._match(tag, self._rts.pop(tag))
        return NixlPostedRecv(self, tag, recv)

    def _match(self, tag: int, remote: tuple[int, int, int]) -> None:
        """The posted receive of `tag` meets the sender's buffer `remote`: read at the end of this
        loop turn, in one READ with every other receive matched in it."""
        if not self._matched:
            self._loop.call_soon(self._start_reads)
        self._matched[tag] = remote

    def _start_reads(self) -> None:
        matched, self._matched = self._matched, {}
        if self.lost or not matched:
            return
        by_kind: dict[tuple[str, str], dict[int, tuple[int, int, int]]] = {}
        for tag, remote in matched.items():
            kinds = (mem_type(self._posted[tag].buf.device.type == "cuda"), mem_type(remote[2] >= 0))
            by_kind.setdefault(kinds, {})[tag] = remote
        try:
            for (here, there), group in by_kind.items():
                self._start_read(group, here, there)
        except Exception as e:
            self._fail(f"cannot read from peer: {e!r}")

    def _start_read(self, group: dict[int, tuple[int, int, int]], here: str, there: str) -> None:
        """One NIXL READ of every (tag -> the sender's (addr, nbytes, device)) in `group` into the
        receives posted under those tags, one descriptor pair per message."""
        recvs = {tag: self._posted[tag] for tag in group}
        local, far = [], []
        for tag, (addr, nbytes, device) in group.items():
            flat = as_bytes(recvs[tag].buf)
            if nbytes != flat.numel():
                raise ConnectionError(
                    f"message {tag:#x} has {nbytes} bytes, the posted receive {flat.numel()}"
                )
            local.append((flat.data_ptr(), nbytes, max(flat.get_device(), 0)))
            far.append((addr, nbytes, max(device, 0)))
        agent, regions = self._agent, self._transport.regions
        acquired = []
        try:
            for recv in recvs.values():
                acquired.append(regions.acquire(recv.buf))
            handle = agent.initialize_xfer(  # NIXL checks every `far` descriptor lies inside a
                "READ",  # registration the peer announced, else it raises
                agent.get_xfer_descs(local, here),
                agent.get_xfer_descs(far, there),
                self.remote,
            )
        except Exception:
            for region in acquired:
                regions.release(region)
            raise
        read = _Read(handle, recvs)
        self._transport.read_requests += 1
        self._transport.messages_read += len(recvs)
        for recv, region in zip(recvs.values(), acquired, strict=True):
            recv.region, recv.read = region, read
        state = agent.transfer(handle)
        self._transport.reads.watch(handle, state, lambda s: self._read_ended(read, s))

    def _read_ended(self, read: _Read, state: str) -> None:
        if self._backend == "UCX" and state == "DONE":
            self._backend = self._agent.query_xfer_backend(read.handle)
        try:
            read.handle.release()
        except Exception as e:  # NIXL keeps a handle it cannot free; nothing more will land
            log.warning("nixl transfer handle not released", tags=len(read.recvs), error=repr(e))
        for tag, recv in read.recvs.items():
            assert recv.region is not None
            self._transport.regions.release(recv.region)
            self._posted.pop(tag, None)
            if state == "DONE" and not self.lost:
                self._write(_DONE, tag, 1)
            if not recv.done.done():
                if state == "DONE":
                    recv.done.set_result(True)
                else:
                    recv.done.set_exception(PeerLost(self.lost_reason or f"NIXL READ of {tag:#x} failed"))
        if state != "DONE":
            self._fail(f"NIXL READ of {len(read.recvs)} message(s) failed")
        if self.lost:
            self._forget_remote()

    # -- sender side -------------------------------------------------------------------------------

    async def send(self, tag: int, buf: torch.Tensor) -> None:
        if self.lost:
            raise PeerLost(self.lost_reason or "peer lost")
        flat = as_bytes(buf)
        region = self._transport.regions.acquire(buf)
        send = self._sends[tag] = _Send(region, buf)
        # from the RTS on, the receiver may READ (even after a cancel): progressed until `_finish_send`
        self._transport.reads.send_started()
        metadata = b"" if region.serial in self._announced else region.metadata
        if self._transport.regions.whole_storage:  # else every region is new: nothing to remember
            self._announced.add(region.serial)
        try:
            # shielded: cancelling this send must not cancel the writer other frames ride on
            await asyncio.shield(
                self._write(_RTS, tag, flat.data_ptr(), flat.numel(), flat.get_device(), metadata)
            )
            await send.taken
        except asyncio.CancelledError:
            if not self.lost and tag in self._sends:
                # The receiver may be reading `buf` now: keep it until its DONE answers WITHDRAWN.
                send.abandoned = True
                self._write(_WITHDRAWN, tag)
                raise
            self._finish_send(tag)
            raise
        except OSError as e:
            self._finish_send(tag)
            raise PeerLost(str(e)) from e
        except PeerLost:
            self._finish_send(tag)
            raise

    def _on_done(self, tag: int, taken: bool) -> None:
        send = self._sends.get(tag)
        if send is None:
            raise ConnectionError(f"DONE for tag {tag:#x}, which we never sent")
        if not send.taken.done():
            send.taken.set_result(taken)
        self._finish_send(tag)

    def _finish_send(self, tag: int) -> None:
        send = self._sends.pop(tag, None)
        if send is not None:
            self._transport.regions.release(send.region)
            self._transport.reads.send_ended()

    # -- one-sided reads (kvtransfer.pull) ---------------------------------------------------------

    def unpack_rkey(self, packed: bytes) -> NixlRemoteKey:
        """The peer's pool source (its `NixlRegion.rkey`, from the control plane) loaded into our
        agent, for `NixlRma.get`; RmaError unless it is a registration of this peer's own agent."""
        if self.lost:
            raise PeerLost(self.lost_reason or "peer lost")
        try:
            device, metadata = unpack_key(packed)
            name = metadata_agent(metadata)
        except ValueError as e:
            raise RmaError(f"not a NIXL pool key: {e}") from e
        if name != self.remote:  # refused before NIXL merges it into that agent's registrations
            raise RmaError(f"the pool key names agent {name!r}, this peer is {self.remote!r}")
        try:
            self._agent.add_remote_agent(metadata)
        except Exception as e:  # NIXL refused the metadata
            raise RmaError(f"not a NIXL pool key: {e!r}") from e
        return NixlRemoteKey(self.remote, device)

    # -- loss --------------------------------------------------------------------------------------

    def _fail(self, reason: str) -> None:
        if self.lost:
            return
        # our reader may be waiting on the socket: a READ that failed in a callback loses the peer
        self._closing = shut_down(self._sock, *[t for t in (self._reader, self._writer) if t is not None])
        self._mark_lost(reason)
        self._matched.clear()
        reads = {r.read for r in self._posted.values() if r.read is not None}
        for tag, recv in list(self._posted.items()):
            if recv.read is None:
                del self._posted[tag]
                recv.done.set_exception(PeerLost(reason))
        for read in reads:  # READs in flight: cancel each; its end (now or later) fails them
            try:
                read.handle.release()
            except Exception:
                continue  # NIXL could not cancel it: the watcher reports its end
            self._transport.reads.forget(read.handle)
            read.handle = _Released()
            self._read_ended(read, "ERR")
        for send in self._sends.values():
            if not send.taken.done() and not send.abandoned:  # nobody awaits an abandoned one
                send.taken.set_exception(PeerLost(reason))
        for tag in [t for t, s in self._sends.items() if s.abandoned]:
            self._finish_send(tag)
        self._rts.clear()
        self._forget_remote()

    def _forget_remote(self) -> None:
        """Disconnect NIXL from the remote agent once no READ of ours from it is in flight."""
        if self.remote and not self._posted:
            self._transport.forget_remote(self.remote)
            self.remote = ""

    async def close(self) -> None:
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)
        if self._closing is not None:
            await self._closing


class _Released:
    """A READ handle NIXL already cancelled and released."""

    def release(self) -> None:
        pass


async def read_frame(sock: socket.socket) -> tuple[int, int, int, int, int, bytes]:
    """One control frame (payload at most MAX_PAYLOAD); ConnectionError when it broke."""
    loop = asyncio.get_running_loop()

    async def exactly(n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = await loop.sock_recv(sock, n - len(out))
            if not chunk:
                raise ConnectionError("connection closed by peer")
            out += chunk
        return out

    kind, tag, addr, nbytes, device, size = _FRAME.unpack(await exactly(_FRAME.size))
    if size > MAX_PAYLOAD:
        raise ConnectionError(f"frame payload of {size} bytes (at most {MAX_PAYLOAD})")
    return kind, tag, addr, nbytes, device, await exactly(size) if size else b""


class NixlTransport(TcpTransport):
    """The NIXL backend: the TCP backend's listener, hello and sockets for control and liveness,
    one NIXL agent per process for the bytes. See the module docstring."""

    backend = "nixl"

    def __init__(
        self, layout: KVLayout, settings: NixlSettings | None = None, key: bytes | None = None
    ) -> None:
        self.settings = settings or NixlSettings()
        super().__init__(layout, key, self.settings.connect_timeout_s)
        self.agent: Any = None
        self._nixl: Any = None
        self.name = f"splitserve-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.regions: Regions
        self.reads: Reads
        self.rma: NixlRma  # one-sided reads (kvtransfer.pull)
        self.read_requests = 0  # NIXL READs this process started, and the messages they carried
        self.messages_read = 0

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self._nixl = nixl = import_nixl()
        config = nixl.nixl_agent_config(enable_prog_thread=self.settings.progress_thread, backends=["UCX"])
        self.agent = nixl.nixl_agent(self.name, config)
        self.regions = Regions(self.agent, self.settings.register == "storage")
        self.reads = Reads(self.agent, progress_sends=not self.settings.progress_thread)
        self.rma = NixlRma(self)
        address = await super().start(host, port)
        log.info("nixl agent ready", name=self.name, settings=self.settings)
        return address

    @staticmethod
    def _tune(sock: socket.socket) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)

    async def _exchange_metadata(self, sock: socket.socket, accepted: bool) -> str:
        """After the hello: swap NIXL agent names and connection metadata (only connection info:
        registrations travel with the RTS that needs them); the remote agent's name. The connecting
        side speaks first, so the accepting side has its peer registered by the time `connect` returns."""
        bindings = self._nixl._bindings
        metadata = self.agent.get_partial_agent_metadata(bindings.nixlRegDList(bindings.DRAM_SEG), True)
        blob = json.dumps({"name": self.name, "metadata": metadata.hex()}).encode()
        ours = _FRAME.pack(_META, 0, 0, 0, -1, len(blob)) + blob
        loop = asyncio.get_running_loop()
        if not accepted:
            await loop.sock_sendall(sock, ours)
        kind, *_, payload = await read_frame(sock)
        try:
            theirs = json.loads(payload) if kind == _META else {}
            metadata = bytes.fromhex(theirs["metadata"])
            name = metadata_agent(metadata)
        except Exception as e:  # not JSON, no or malformed metadata
            raise ConnectionError(f"no valid NIXL metadata after the hello: {e!r}") from e
        # Checked before NIXL loads it (it would merge into an agent it already knows): the blob
        # must be the claimed agent's, and no agent we already talk to, nor our own.
        if name != theirs.get("name"):
            raise ConnectionError(
                f"NIXL metadata names agent {name!r}, the peer claimed {theirs.get('name')!r}"
            )
        if name == self.name or name in self._remote_agents():
            raise ConnectionError(f"NIXL agent {name!r} is already connected here")
        try:
            self.agent.add_remote_agent(metadata)
        except Exception as e:  # NIXL refused it
            raise ConnectionError(f"no valid NIXL metadata after the hello: {e!r}") from e
        if accepted:
            await loop.sock_sendall(sock, ours)
        return name

    async def _pair(self, address: str, sock: socket.socket, accepted: bool) -> Peer:
        async with asyncio.timeout(self.connect_timeout_s):  # no task of its own: no await after it
            remote = await self._exchange_metadata(sock, accepted)
        return NixlPeer(address, sock, self, remote)

    def _remote_agents(self) -> set[str]:
        """The NIXL agents of our live peers."""
        return {p.remote for p in self._peers.values() if isinstance(p, NixlPeer) and not p.lost}

    def forget_remote(self, name: str) -> None:
        """Disconnect NIXL from a remote agent, once no pull READ of ours from it is in flight."""
        if self.rma.reading_from(name):
            self.rma.forget_when_done(name)
            return
        try:
            self.agent.remove_remote_agent(name)
        except Exception as e:  # already gone
            log.debug("nixl remote agent not removed", remote=name, error=repr(e))

    async def close(self) -> None:
        await super().close()
        if self.agent is not None:
            self.rma.close()
            self.regions.close()
