"""The ZeroMQ control channel: one `Envelope` (control.proto) per message, bounded send queues.

Topology (every process uses these helpers, nothing else touches ZeroMQ directly):

    coordinator  ROUTER  bind  tcp://*:CONTROL_PORT   <- each worker's DEALER (identity = worker_id)
    every worker ROUTER  bind  its control_address    <- each peer worker's DEALER (identity = worker_id)

Coordinator -> worker messages go out of the coordinator's ROUTER to the worker's DEALER; worker ->
coordinator messages go out of that DEALER. P <-> D messages go from the sender's DEALER (one per
peer, cached) to the receiver's ROUTER, so the receiver always learns the sender's worker id.

Backpressure: sends never block. When a peer's queue is at its high-water mark, `send` raises
`ControlQueueFull`; the caller treats the peer as failed (never a silent drop). Bulk KV bytes never
use these sockets.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog
import zmq
import zmq.asyncio

from splitserve.v1 import control_pb2

log = structlog.get_logger(__name__)

DEFAULT_HWM = 10_000


class ControlQueueFull(RuntimeError):
    """The peer's send queue is full: it is not reading. Treat the peer as failed."""


@dataclass(slots=True)
class Received:
    """One decoded message; `sender` is the peer's worker id on ROUTER sockets, "" on DEALERs."""

    sender: str
    envelope: control_pb2.Envelope

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
    """

    def __init__(self, ctx: zmq.asyncio.Context, kind: int, hwm: int = DEFAULT_HWM) -> None:
        self.sock = ctx.socket(kind)
        self.is_router = kind == zmq.ROUTER
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, hwm)
        self.sock.setsockopt(zmq.RCVHWM, hwm)
        if self.is_router:
            # an unknown identity is an error, not a silent drop
            self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)

    @classmethod
    def router(cls, ctx: zmq.asyncio.Context, bind: str, hwm: int = DEFAULT_HWM) -> ControlSocket:
        """Bind a ROUTER; `bind` may use port 0 (`tcp://127.0.0.1:0`), see `address`."""
        s = cls(ctx, zmq.ROUTER, hwm)
        if bind.endswith(":0"):
            port = s.sock.bind_to_random_port(bind[: -len(":0")])
            log.debug("router bound", address=f"{bind[:-2]}:{port}")
        else:
            s.sock.bind(bind)
        return s

    @classmethod
    def dealer(
        cls, ctx: zmq.asyncio.Context, connect: str, identity: str, hwm: int = DEFAULT_HWM
    ) -> ControlSocket:
        s = cls(ctx, zmq.DEALER, hwm)
        s.sock.setsockopt(zmq.IDENTITY, identity.encode())
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
        if self.is_router:
            sender, payload = await self.sock.recv_multipart()
            return Received(sender.decode(), control_pb2.Envelope.FromString(payload))
        payload = await self.sock.recv()
        return Received("", control_pb2.Envelope.FromString(payload))

    def close(self) -> None:
        self.sock.close(linger=0)
