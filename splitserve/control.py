"""The ZeroMQ control channel: one `Envelope` (control.proto) per message, bounded send queues, every
received frame untrusted.

Topology (every process uses these helpers, nothing else touches ZeroMQ directly):

    coordinator  ROUTER  bind  tcp://*:CONTROL_PORT   <- each worker's DEALER (identity = worker_id)
    every worker ROUTER  bind  its control_address    <- each peer worker's DEALER (identity = worker_id)

Coordinator -> worker messages go out of the coordinator's ROUTER to the worker's DEALER; worker ->
coordinator messages go out of that DEALER. P <-> D messages go from the sender's DEALER (one per
peer, cached) to the receiver's ROUTER, so the receiver always learns the sender's worker id.

Authentication (splitserve/control_auth.py): with `keys` every ROUTER is a CurveZMQ server and every
DEALER a CurveZMQ client that verifies its server's public key; the ZAP handler of the socket's
context decides which client keys may connect, and `Received.user_id` names the key that sent a message.

Untrusted input: `recv` never raises on what a peer sent. Oversized messages are refused by libzmq
(ZMQ_MAXMSGSIZE, the peer is disconnected); a wrong frame count, a routing id that is not a valid
worker id, bytes that are not an `Envelope`, or an `Envelope` with no known kind are dropped, counted
through `on_drop(reason)` and logged rate-limited, and `recv` waits for the next message.

Backpressure: sends never block. When a peer's queue is at its high-water mark, `send` raises
`ControlQueueFull`; the caller treats the peer as failed (never a silent drop). Bulk KV bytes never
use these sockets.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
import zmq
import zmq.asyncio

from splitserve.control_flags import WORKER_ID_PATTERN
from splitserve.logs import RateLimitedLog
from splitserve.v1 import control_pb2

log = structlog.get_logger(__name__)

DEFAULT_HWM = 10_000
# The largest legit control message is a Prefill/Decode whose ExecutionRequest carries a 1M-token
# context twice as packed int32 (prompt + output so far: 8 MiB) or a Heartbeat's full prefix-cache
# snapshot of a 1M-block pool (8 bytes a block: 8 MiB). Twice that is the bound; libzmq drops a
# connection that sends more before any of it reaches Python.
MAX_CONTROL_MESSAGE_BYTES = 16 << 20
_DROP_LOG_PERIOD_S = 10.0
_KINDS = frozenset(f.name for f in control_pb2.Envelope.DESCRIPTOR.oneofs_by_name["msg"].fields)


class ControlQueueFull(RuntimeError):
    """The peer's send queue is full: it is not reading. Treat the peer as failed."""


def valid_worker_id(worker_id: str) -> bool:
    return WORKER_ID_PATTERN.fullmatch(worker_id) is not None


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """This process's CurveZMQ keypair (z85). Loaded by control_auth; never logged."""

    public: bytes
    secret: bytes = field(repr=False)


@dataclass(slots=True)
class Received:
    """One validated message. `sender` is the peer's worker id on ROUTER sockets ("" on DEALERs);
    `user_id` is the z85 public key that authenticated the connection ("" without CURVE or on DEALERs)."""

    sender: str
    envelope: control_pb2.Envelope
    user_id: str = ""

    @property
    def kind(self) -> str:
        return self.envelope.WhichOneof("msg") or ""


def envelope(**msg: object) -> control_pb2.Envelope:
    """`envelope(prefill=control_pb2.Prefill(...))` -> an Envelope with that one field set."""
    if len(msg) != 1:
        raise ValueError("an envelope carries exactly one message")
    return control_pb2.Envelope(**msg)  # type: ignore[arg-type]


class ControlSocket:
    """A ROUTER (bound) or DEALER (connected) socket speaking `Envelope`s.

    Owned by one asyncio task group in one process; `close()` drops unsent messages (linger 0).
    `on_drop(reason)` is called once per dropped message (the owner counts it in its metrics).
    """

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        kind: int,
        hwm: int = DEFAULT_HWM,
        *,
        on_drop: Callable[[str], None] | None = None,
        name: str = "control",
    ) -> None:
        self.sock = ctx.socket(kind)
        self.is_router = kind == zmq.ROUTER
        self.on_drop = on_drop or (lambda reason: None)
        self.curve = False
        self._drop_log = RateLimitedLog("control input dropped", _DROP_LOG_PERIOD_S, at=name)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, hwm)
        self.sock.setsockopt(zmq.RCVHWM, hwm)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_MESSAGE_BYTES)
        if self.is_router:
            # an unknown identity is an error, not a silent drop
            self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)

    @classmethod
    def router(
        cls,
        ctx: zmq.asyncio.Context,
        bind: str,
        hwm: int = DEFAULT_HWM,
        *,
        keys: CurveKeys | None = None,
        on_drop: Callable[[str], None] | None = None,
    ) -> ControlSocket:
        """Bind a ROUTER; `bind` may use port 0 (`tcp://127.0.0.1:0`), see `address`. With `keys` it is
        a CURVE server: the context's ZAP handler (control_auth) must be running."""
        s = cls(ctx, zmq.ROUTER, hwm, on_drop=on_drop, name=f"router {bind}")
        if keys is not None:
            s.curve = True
            s.sock.setsockopt(zmq.CURVE_SERVER, 1)
            s.sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
            s.sock.setsockopt(zmq.ZAP_DOMAIN, b"splitserve")
        if bind.endswith(":0"):
            port = s.sock.bind_to_random_port(bind[: -len(":0")])
            log.debug("router bound", address=f"{bind[:-2]}:{port}", curve=s.curve)
        else:
            s.sock.bind(bind)
        return s

    @classmethod
    def dealer(
        cls,
        ctx: zmq.asyncio.Context,
        connect: str,
        identity: str,
        hwm: int = DEFAULT_HWM,
        *,
        keys: CurveKeys | None = None,
        server_key: bytes | None = None,
        on_drop: Callable[[str], None] | None = None,
    ) -> ControlSocket:
        """Connect a DEALER with routing id `identity`. With `keys` it is a CURVE client that only
        completes the handshake with the holder of `server_key`'s secret."""
        if (keys is None) != (server_key is None):
            raise ValueError("a CURVE DEALER needs both its own keys and the server's public key")
        s = cls(ctx, zmq.DEALER, hwm, on_drop=on_drop, name=f"dealer {connect}")
        s.sock.setsockopt(zmq.IDENTITY, identity.encode())
        if keys is not None and server_key is not None:
            s.curve = True
            s.sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
            s.sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
            s.sock.setsockopt(zmq.CURVE_SERVERKEY, server_key)
        s.sock.connect(connect)
        return s

    @property
    def address(self) -> str:
        """The bound endpoint with the OS-chosen port filled in (e.g. `tcp://127.0.0.1:40123`)."""
        endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT)
        return endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)

    async def send(self, env: control_pb2.Envelope, to: str | None = None) -> None:
        """Queue one message; ROUTER sockets need `to` (the peer's worker id). Never blocks."""
        payload = env.SerializeToString()
        try:
            if self.is_router:
                if to is None:
                    raise ValueError("a ROUTER send needs the destination worker id")
                await self.sock.send_multipart([to.encode(), payload], flags=zmq.NOBLOCK)
            else:
                await self.sock.send(payload, flags=zmq.NOBLOCK)
        except zmq.Again as exc:
            raise ControlQueueFull(f"control queue to {to or 'peer'} is full") from exc
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                raise ControlQueueFull(f"control peer {to} is not connected") from exc
            raise

    async def recv(self) -> Received:
        """The next valid message; invalid ones are dropped (see the module docstring). Raises only
        when the socket itself fails (closed, context terminated)."""
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            got = self._parse(frames)
            if got is not None:
                return got

    def drop(self, reason: str, **detail: Any) -> None:
        """Count and (rate-limited) log one dropped message; also for handlers that reject one."""
        self.on_drop(reason)
        self._drop_log(reason, **detail)

    def _parse(self, frames: list[zmq.Frame]) -> Received | None:
        sender, user_id = "", ""
        if self.is_router:
            if len(frames) != 2:
                self.drop("frame_count", frames=len(frames))
                return None
            raw_id = frames[0].bytes
            sender = raw_id.decode("ascii", "replace")
            if not raw_id.isascii() or not valid_worker_id(sender):
                self.drop("routing_id", routing_id=raw_id[:64].hex())
                return None
            if self.curve:
                user_id = _user_id(frames[1])
        elif len(frames) != 1:
            self.drop("frame_count", frames=len(frames))
            return None
        try:
            env = control_pb2.Envelope.FromString(frames[-1].bytes)
        except Exception:  # any parse failure of untrusted bytes is the sender's fault, not ours
            self.drop("decode", sender=sender, size=len(frames[-1].bytes))
            return None
        kind = env.WhichOneof("msg")
        if kind is None or kind not in _KINDS:
            self.drop("kind", sender=sender)
            return None
        return Received(sender, env, user_id)

    def close(self) -> None:
        self.sock.close(linger=0)


def _user_id(frame: zmq.Frame) -> str:
    try:
        return str(frame.get("User-Id"))
    except zmq.ZMQError:  # no ZAP user id: not authenticated (cannot happen on a CURVE server)
        return ""
