"""Transfer sessions: one per (request id, generation), on each side, with a lease.

Both sides of a session are built with the same `secret` (drawn by the receiver, handed to the sender
over the authenticated control plane): every message tag derives from it (kvtransfer.plan).

The receiver (decode side) and the sender (prefill side) each hold one session for a request. How
"done", "ack" and "abort" travel between them (ZeroMQ control messages in the serving path) is not
this module's business: whoever learns one calls `mark_done`, `acknowledged` or `abort`.

Receiver (`RecvSession`), created by the decode worker after it reserved `block_ids`::

    ACTIVE --(all messages landed and mark_done(first_token))--> DONE: the caller owns the blocks
       |
       +--(abort(reason) | lease expired | peer lost | checksum mismatch)--> ABORTING
              cancel every posted receive, await each one's end (data or confirmed cancel)
              --> release(block_ids), once --> ABORTED

Sender (`SendSession`), created by the prefill worker once it knows the receiver's block ids::

    ACTIVE --send(upto)...--> (caller sends KVDone) --acknowledged()--> release(src), once --> DONE
       |
       +--(abort(reason) | lease expired | peer lost)--> abandon in-flight sends
              --> release(src), once --> ABORTED

`release` is the owner's callback (e.g. `BlockPool.free`, or a prefix-cache retain on the sender)
and is called at most once, from the event loop. A receiver's receives are posted by `start()`,
which must run before the sender learns the block ids, so no message ever finds no buffer posted.
An abandoned send can only be read (never written) by a receiver whose session is aborted.
"""

from __future__ import annotations

import asyncio
import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog
import torch

from kernels import gather_blocks, scatter_blocks
from kvtransfer import staging
from kvtransfer.checksum import block_checksums
from kvtransfer.errors import PeerLost, SessionAborted, TransportError
from kvtransfer.plan import Message, check_session_secret, consecutive_start, message_tag, plan_messages
from kvtransfer.transport import Peer, PostedRecv

log = structlog.get_logger(__name__)

Release = Callable[[list[int]], None]


class SessionState(enum.Enum):
    ACTIVE = "active"
    ABORTING = "aborting"
    DONE = "done"
    ABORTED = "aborted"


@dataclass(frozen=True, slots=True)
class SessionKey:
    request_id: str
    generation: int


@dataclass(frozen=True)
class SessionConfig:
    """Tunables both sides of a session must agree on (the message plan depends on the last two)."""

    lease_s: float = 30.0
    max_inflight: int = 4
    max_message_bytes: int = 64 << 20
    min_direct_bytes: int = 256 << 10


class _Session(ABC):
    """What both sides share: key, peer, blocks, the plan, the lease and the exactly-once release."""

    def __init__(
        self,
        peer: Peer,
        key: SessionKey,
        secret: bytes,
        cache: torch.Tensor,
        block_ids: Sequence[int],
        plan_ids: Sequence[int],
        release: Release,
        config: SessionConfig,
    ) -> None:
        check_session_secret(secret)
        self.peer, self.key, self.cache, self.config = peer, key, cache, config
        self._secret = secret
        self.block_ids = list(block_ids)
        block_bytes = cache[0].numel() * cache.element_size()
        self.messages = plan_messages(
            plan_ids, block_bytes, config.max_message_bytes, config.min_direct_bytes
        )
        self.state = SessionState.ACTIVE
        self.abort_reason: str | None = None
        self._release, self._released = release, False
        loop = asyncio.get_running_loop()
        self._result: asyncio.Future[int | None] = loop.create_future()
        self._lease = loop.call_later(config.lease_s, self.abort, "lease expired")
        self._unsubscribe = peer.on_lost(lambda reason: self.abort(f"peer lost: {reason}"))
        self._log = log.bind(rid=key.request_id, gen=key.generation, peer=peer.address)
        self._staging = staging.pool_for(cache)  # packed messages' buffers, lent per message

    def tag(self, message: Message) -> int:
        return message_tag(self._secret, message.index)

    def _ids(self, ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self.cache.device)

    def _release_once(self) -> None:
        if not self._released:
            self._released = True
            self._release(self.block_ids)

    def _end(self, state: SessionState, result: int | None = None) -> None:
        self._lease.cancel()
        self._unsubscribe()
        self.state = state
        if self._result.done():
            return
        if state is SessionState.DONE:
            self._result.set_result(result)
        else:
            self._result.set_exception(SessionAborted(self.abort_reason or "aborted"))
            self._result.exception()  # a session nobody waits on must not log "never retrieved"

    def renew(self, lease_s: float | None = None) -> None:
        """Restart the lease from now (`lease_s`, default the config's): the owner saw progress. A
        no-op once the session left ACTIVE."""
        if self.state is SessionState.ACTIVE:
            self._lease.cancel()
            delay = self.config.lease_s if lease_s is None else lease_s
            self._lease = asyncio.get_running_loop().call_later(delay, self.abort, "lease expired")

    async def wait(self) -> int | None:
        """The first token (receiver) or None (sender) at DONE; raises SessionAborted otherwise."""
        return await asyncio.shield(self._result)

    def abort(self, reason: str) -> None:
        """End the session (idempotent; a no-op once DONE). Blocks are released once it is safe."""
        if self.state is not SessionState.ACTIVE:
            return
        self.abort_reason = reason
        self.state = SessionState.ABORTING
        self._log.info("kv session aborting", reason=reason)
        task = asyncio.ensure_future(self._finish_abort())
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    @abstractmethod
    async def _finish_abort(self) -> None:
        """Wind down in-flight operations, then `_release_once()` and `_end(ABORTED)`."""


class SinkSession(_Session):
    """What both decode-side sessions share: KVDone, the checksum check and DONE once every byte
    landed. Subclasses say when that is (`_all_landed`) and call `_maybe_finish` as bytes land."""

    def __init__(
        self,
        peer: Peer,
        key: SessionKey,
        secret: bytes,
        cache: torch.Tensor,
        block_ids: Sequence[int],
        plan_ids: Sequence[int],
        release: Release,
        config: SessionConfig | None,
    ) -> None:
        super().__init__(peer, key, secret, cache, block_ids, plan_ids, release, config or SessionConfig())
        self._first_token: int | None = None
        self._checksums: list[int] | None = None
        self._done_marked = False

    def mark_done(self, first_token: int, checksums: Sequence[int] | None = None) -> None:
        """The sender finished (KVDone): its first sampled token and, optionally, per-block CRC-32s."""
        self._first_token, self._done_marked = first_token, True
        self._checksums = list(checksums) if checksums is not None else None
        self._maybe_finish()

    @abstractmethod
    def _all_landed(self) -> bool:
        """Every block's bytes are in place."""

    def _on_done(self) -> None:
        """Called once, just before the session becomes DONE."""

    def _maybe_finish(self) -> None:
        if self.state is not SessionState.ACTIVE or not self._done_marked or not self._all_landed():
            return
        if self._checksums is not None and block_checksums(self.cache, self.block_ids) != self._checksums:
            self.abort("checksum mismatch")
            return
        self._on_done()
        self._end(SessionState.DONE, self._first_token)
        self._log.debug("kv session received", blocks=len(self.block_ids), messages=len(self.messages))


class RecvSession(SinkSession):
    """Decode side: receives into `block_ids` (reserved by the caller). See the module docstring."""

    def __init__(
        self,
        peer: Peer,
        key: SessionKey,
        secret: bytes,
        cache: torch.Tensor,
        block_ids: Sequence[int],
        release: Release,
        config: SessionConfig | None = None,
    ) -> None:
        super().__init__(peer, key, secret, cache, block_ids, block_ids, release, config)
        self._posted: list[PostedRecv] = []
        self._landed: list[asyncio.Task[bool]] = []

    def start(self) -> None:
        """Post every message's receive buffer. Call before sending the block ids to the sender.

        Never raises for a lost peer: the session aborts instead (and `wait()` says so)."""
        if self._posted or self.state is not SessionState.ACTIVE:
            return
        for message in self.messages:
            ids = self.block_ids[message.start : message.stop]
            if message.direct:
                buf, packed = self.cache[ids[0] : ids[-1] + 1], None
            else:
                buf = packed = self._staging.take(message.num_blocks)
            try:
                posted = self.peer.post_recv(self.tag(message), buf)
            except BaseException as e:
                if packed is not None:
                    self._staging.give(packed)  # never posted: nothing touches it
                if not isinstance(e, PeerLost):
                    raise
                self.abort(f"peer lost: {e}")
                return
            self._posted.append(posted)
            landed = asyncio.ensure_future(self._land(posted, ids, packed))
            # checked once the task is done: KVDone may arrive before the last byte lands (TCP's
            # sender finishes when the kernel has the bytes), and a landing task cannot see itself done
            landed.add_done_callback(lambda _: self._maybe_finish())
            self._landed.append(landed)

    async def _land(self, posted: PostedRecv, ids: list[int], packed: torch.Tensor | None) -> bool:
        try:
            landed = await posted.wait()
        except BaseException as e:
            if packed is not None:  # the transport may still write into it: never reused
                self._staging.drop(packed)
            if isinstance(e, PeerLost):
                self.abort(f"peer lost: {e}")
                return False
            raise
        if packed is not None:
            if landed:
                scatter_blocks(self.cache, self._ids(ids), packed)
            self._staging.give(packed)  # landed and scattered, or withdrawn unread
        return landed

    @property
    def messages_landed(self) -> int:
        """How many of the session's messages have landed so far."""
        return sum(t.done() and not t.cancelled() and t.result() for t in self._landed)

    def _all_landed(self) -> bool:
        return len(self._landed) == len(self.messages) and all(
            t.done() and not t.cancelled() and t.result() for t in self._landed
        )

    async def _finish_abort(self) -> None:
        for posted in self._posted:
            posted.cancel()
        # Wait (protects an invariant): a block goes back to the pool only after its receive
        # completed or was confirmed cancelled, so no byte can land in a block someone else holds.
        await asyncio.gather(*self._landed, return_exceptions=True)
        self._release_once()
        self._end(SessionState.ABORTED)


class SourceSession(_Session):
    """What both prefill-side sessions share: the source blocks, held until KVAck or abort.

    The sources may be a prefix of the sequence's `num_blocks` blocks (chunked prefill has not made
    the rest yet): `extend_sources` appends blocks as they become final. `release` receives every
    source id ever given."""

    def __init__(
        self,
        peer: Peer,
        key: SessionKey,
        secret: bytes,
        cache: torch.Tensor,
        src_block_ids: Sequence[int],
        num_blocks: int,
        plan_ids: Sequence[int],
        release: Release,
        config: SessionConfig | None,
    ) -> None:
        if len(src_block_ids) > num_blocks:
            raise ValueError(f"{len(src_block_ids)} source blocks for {num_blocks} reserved blocks")
        super().__init__(
            peer, key, secret, cache, src_block_ids, plan_ids, release, config or SessionConfig()
        )
        self.num_blocks = num_blocks

    def extend_sources(self, src_block_ids: Sequence[int]) -> None:
        """Append source blocks (the next logical blocks, in order) whose KV is now final."""
        if len(self.block_ids) + len(src_block_ids) > self.num_blocks:
            raise ValueError(f"more than {self.num_blocks} source blocks for this session")
        self.block_ids.extend(src_block_ids)

    def checksums(self) -> list[int]:
        """Per-block CRC-32 of the source blocks, to ship with KVDone for end-to-end verification."""
        return block_checksums(self.cache, self.block_ids)

    def acknowledged(self) -> None:
        """The receiver confirmed it holds the data: release the source blocks and finish."""
        if self.state is not SessionState.ACTIVE:
            return
        self._release_once()
        self._end(SessionState.DONE)


class SendSession(SourceSession):
    """Prefill side: sends `src_block_ids` into the receiver's `dst_block_ids`, message by message;
    `send(upto)` needs sources up to `upto` (see `SourceSession`)."""

    def __init__(
        self,
        peer: Peer,
        key: SessionKey,
        secret: bytes,
        cache: torch.Tensor,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        release: Release,
        config: SessionConfig | None = None,
    ) -> None:
        super().__init__(
            peer, key, secret, cache, src_block_ids, len(dst_block_ids), dst_block_ids, release, config
        )
        self._next = 0
        self._inflight = asyncio.Semaphore(self.config.max_inflight)
        self._sends: list[asyncio.Task[None]] = []

    async def send(self, upto: int | None = None) -> None:
        """Send every message whose blocks all lie below logical block `upto` (None: all blocks) and
        return once they are delivered; raises SessionAborted if the session ended. Call again (one
        call at a time) as prefill produces more blocks; ship KVDone only after `send()` returned."""
        limit = self.num_blocks if upto is None else upto
        if limit > len(self.block_ids):
            raise ValueError(f"send(upto={limit}) but only {len(self.block_ids)} source blocks are known")
        while self._next < len(self.messages) and self.messages[self._next].stop <= limit:
            if self.state is not SessionState.ACTIVE:
                break
            await self._inflight.acquire()
            self._sends.append(asyncio.ensure_future(self._send_one(self.messages[self._next])))
            self._next += 1
        await asyncio.gather(*self._sends, return_exceptions=True)
        if self.state is not SessionState.ACTIVE:
            raise SessionAborted(self.abort_reason or "aborted")

    async def _send_one(self, message: Message) -> None:
        packed, delivered = None, False
        try:
            ids = self.block_ids[message.start : message.stop]
            first = consecutive_start(ids)
            if first is not None:
                buf = self.cache[first : first + len(ids)]
            else:
                packed = self._staging.take(len(ids))
                buf = gather_blocks(self.cache, self._ids(ids), out=packed)
                staging.queued_work_done(packed)
            await self.peer.send(self.tag(message), buf)
            delivered = True
        except (PeerLost, TransportError) as e:
            self.abort(f"send failed: {e}")
        finally:
            if packed is not None and delivered:
                self._staging.give(packed)  # nothing reads it any more
            elif packed is not None:
                self._staging.drop(packed)  # the peer may still be reading it (a cancelled send)
            self._inflight.release()

    async def _finish_abort(self) -> None:
        for send in self._sends:
            send.cancel()
        await asyncio.gather(*self._sends, return_exceptions=True)
        self._release_once()
        self._end(SessionState.ABORTED)
