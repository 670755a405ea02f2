"""What an attacker sends to a control ROUTER: the named malformed-frame cases of issue 10 and a
seeded fuzz corpus (structured Envelopes of every kind with random fields, and raw byte mutations).

`Attacker` is a raw ZeroMQ DEALER (not our ControlSocket, so it can send what ours never would); with
`keys` it authenticates like a peer whose key was stolen, so its frames reach the parser.
`SPLITSERVE_FUZZ_CASES` sets the fuzz count (`make fuzz` runs 10,000).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from dataclasses import dataclass

import zmq
import zmq.asyncio
from google.protobuf import descriptor
from zmq.utils.monitor import parse_monitor_message

from splitserve.control import CurveKeys, envelope
from splitserve.v1 import control_pb2

FUZZ_CASES = int(os.environ.get("SPLITSERVE_FUZZ_CASES", "300"))
_HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
)
KINDS = [f.name for f in control_pb2.Envelope.DESCRIPTOR.oneofs_by_name["msg"].fields]


@dataclass(frozen=True, slots=True)
class Case:
    """One attack: the frames the DEALER sends (it adds no routing id; the ROUTER prepends one) and
    the DEALER's own routing id (None: let ZeroMQ generate one, usually not UTF-8)."""

    name: str
    frames: list[bytes]
    identity: bytes | None = b"attacker"


def named_cases() -> list[Case]:
    """The issue's list: random bytes, truncated Envelope, 3-frame message, 32 MiB frame, non-UTF-8
    routing id, a DEALER with no identity, plus an Envelope with no kind and one with an unknown kind."""
    valid = envelope(abort=control_pb2.Abort(rid=1, generation=1, message="x" * 40)).SerializeToString()
    rng = random.Random(10)
    return [
        Case("random_bytes", [rng.randbytes(64)]),
        Case("truncated_envelope", [valid[: len(valid) // 2]]),
        Case("three_frames", [b"a", valid]),
        Case("no_kind", [b""]),
        Case("unknown_kind", [b"\xf8\x06\x01"]),  # field 111, varint 1: not a kind we know
        Case("non_utf8_routing_id", [valid], identity=b"\xff\xfe\x00bad"),
        Case("no_identity", [valid], identity=None),
        Case("frame_32mib", [b"\x00" * (32 << 20)], identity=b"attacker-big"),  # its link is cut
    ]


def _random_value(rng: random.Random, field: descriptor.FieldDescriptor, depth: int) -> object:
    t = field.type
    if t == descriptor.FieldDescriptor.TYPE_MESSAGE:
        msg = field.message_type._concrete_class()
        fill(rng, msg, depth + 1)
        return msg
    if t == descriptor.FieldDescriptor.TYPE_STRING:
        return "".join(rng.choice("ab-0\u00e9\u4e2d") for _ in range(rng.randrange(0, 12)))
    if t == descriptor.FieldDescriptor.TYPE_BYTES:
        return rng.randbytes(rng.choice((0, 1, 3, 4, 7, 8, 64)))
    if t == descriptor.FieldDescriptor.TYPE_BOOL:
        return rng.random() < 0.5
    if t == descriptor.FieldDescriptor.TYPE_ENUM:
        return rng.choice([v.number for v in field.enum_type.values] + [99])
    if t in (descriptor.FieldDescriptor.TYPE_FLOAT, descriptor.FieldDescriptor.TYPE_DOUBLE):
        return rng.choice((0.0, -1.0, 1e30, float("nan"), rng.random()))
    unsigned = t in (
        descriptor.FieldDescriptor.TYPE_UINT32,
        descriptor.FieldDescriptor.TYPE_UINT64,
        descriptor.FieldDescriptor.TYPE_FIXED32,
        descriptor.FieldDescriptor.TYPE_FIXED64,
    )
    wide = t in (
        descriptor.FieldDescriptor.TYPE_UINT64,
        descriptor.FieldDescriptor.TYPE_INT64,
        descriptor.FieldDescriptor.TYPE_FIXED64,
        descriptor.FieldDescriptor.TYPE_SINT64,
        descriptor.FieldDescriptor.TYPE_SFIXED64,
    )
    top = (1 << 63) - 1 if wide else (1 << 31) - 1
    value = rng.choice((0, 1, 2, 7, top, rng.randrange(top)))
    return value if unsigned or rng.random() < 0.7 else -value


def fill(rng: random.Random, msg: object, depth: int = 0) -> None:
    """Set a random subset of `msg`'s fields to random (often extreme) values."""
    for field in msg.DESCRIPTOR.fields:  # type: ignore[attr-defined]
        if depth > 3 or rng.random() < 0.4:
            continue
        if field.is_repeated:
            target = getattr(msg, field.name)
            for _ in range(rng.randrange(0, 3)):
                value = _random_value(rng, field, depth)
                target.add().CopyFrom(value) if field.message_type else target.append(value)
        elif field.message_type:
            getattr(msg, field.name).CopyFrom(_random_value(rng, field, depth))
        else:
            setattr(msg, field.name, _random_value(rng, field, depth))


def fuzz_cases(seed: int, count: int = FUZZ_CASES) -> Iterator[Case]:
    """`count` cases: ~2/3 structured Envelopes (every kind in turn, random fields), the rest raw
    (bit flips, truncations, random bytes, extra frames) of a structured one."""
    rng = random.Random(seed)
    for i in range(count):
        kind = KINDS[i % len(KINDS)]
        env = control_pb2.Envelope()
        fill(rng, getattr(env, kind))
        getattr(env, kind).SetInParent()
        payload = env.SerializeToString()
        mode = rng.randrange(6)
        if mode == 0 and payload:
            flipped = bytearray(payload)
            flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
            payload = bytes(flipped)
        elif mode == 1:
            payload = payload[: rng.randrange(len(payload) + 1)]
        elif mode == 2:
            payload = rng.randbytes(rng.randrange(1, 200))
        frames = [payload, payload] if mode == 3 and rng.random() < 0.5 else [payload]
        yield Case(f"fuzz-{seed}-{i}-{kind}", frames)


class Attacker:
    """Raw DEALERs to one ROUTER, one per routing id, closed by `close()`."""

    def __init__(
        self,
        address: str,
        keys: CurveKeys | None = None,
        server_key: bytes | None = None,
    ) -> None:
        self.ctx = zmq.asyncio.Context()
        self.address = address if "://" in address else f"tcp://{address}"
        self.keys, self.server_key = keys, server_key
        self._socks: dict[bytes | None, zmq.asyncio.Socket] = {}
        self._monitors: dict[bytes | None, zmq.asyncio.Socket] = {}

    def _sock(self, identity: bytes | None) -> zmq.asyncio.Socket:
        sock = self._socks.get(identity)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if identity is not None:
                sock.setsockopt(zmq.IDENTITY, identity)
            if self.keys is not None and self.server_key is not None:
                sock.setsockopt(zmq.CURVE_PUBLICKEY, self.keys.public)
                sock.setsockopt(zmq.CURVE_SECRETKEY, self.keys.secret)
                sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_key)
            self._monitors[identity] = sock.get_monitor_socket(_HANDSHAKE_EVENTS)
            sock.connect(self.address)
            self._socks[identity] = sock
        return sock

    async def handshake(self, identity: bytes | None = b"attacker") -> str:
        """How the connection of `identity`'s DEALER ended its handshake: "ok", "auth" (the server's
        ZAP handler refused the key) or "protocol" (no common mechanism / wrong server key)."""
        self._sock(identity)
        while True:
            event = parse_monitor_message(await self._monitors[identity].recv_multipart())["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return "ok"
            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                return "auth"
            if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                return "protocol"

    async def send(self, case: Case) -> None:
        await self._sock(case.identity).send_multipart(case.frames)

    def close(self) -> None:
        for sock in [*self._monitors.values(), *self._socks.values()]:
            sock.close(linger=0)
        self.ctx.term()
