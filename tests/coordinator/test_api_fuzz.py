"""Seeded API fuzzing over every RPC of the real coordinator: structured protobuf mutations and raw bytes.

Each case is either a request message of a random RPC with random fields set to edge values (extreme
numbers, NaN, long or odd strings, unknown enum values, deep and repeated sub-messages, template kwargs)
under random credentials, or raw bytes (random, or a serialized request with bytes flipped, cut or
appended) sent with a generic channel call. Every case must end with a status the API documents:
never UNKNOWN or INTERNAL, the coordinator keeps running, and a canary request of another API key,
streaming throughout, finishes unharmed with exactly its tokens.

`make test` runs SPLITSERVE_FUZZ_CASES (default 300) cases; `make fuzz` runs 10,000
(`-m fuzz`, SPLITSERVE_FUZZ_CASES=10000). SPLITSERVE_FUZZ_SEED picks another seed; a failure names
its case number and the seed reproduces it.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest
from google.protobuf import struct_pb2
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2

from splitserve.v1 import serving_pb2 as pb
from tests.coordinator.conftest import ADMIN_KEY, Cluster
from tests.coordinator.peer import ScriptedWorker
from tests.coordinator.test_integration import collect, greedy

pytestmark = pytest.mark.fuzz
StartCluster = Callable[..., Awaitable[Cluster]]
CASES = int(os.environ.get("SPLITSERVE_FUZZ_CASES", "300"))
SEED = int(os.environ.get("SPLITSERVE_FUZZ_SEED", "20261201"))
FUZZ_KEY, CANARY_KEY, CANARY = "fuzz-key", "canary-key", "canary"
FORBIDDEN = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
BATCH = 8  # cases in flight at once
SERVICES = [pb.DESCRIPTOR.services_by_name[n] for n in ("InferenceService", "ModelService", "AdminService")]
SERVICES.append(health_pb2.DESCRIPTOR.services_by_name["Health"])
METHODS = [m for s in SERVICES for m in s.methods]
MODULES = {pb.DESCRIPTOR.package: pb, health_pb2.DESCRIPTOR.package: health_pb2}

INTS = [0, 1, 2, 7, 255, 4096, 2**31 - 1, 2**32 - 1, 2**63 - 1, -1, -(2**31)]
FLOATS = [0.0, 1.0, -1.0, 0.5, 1e-30, 1e30, -1e30, math.nan, math.inf, -math.inf, 2.0, 100.0]
STRINGS = ["", "tiny", "hello world", "\x00", "\ud7ff\ue000", "é" * 50, "user", "assistant", "system",
           "{{ x }}", "{% for i in range(9) %}{% endfor %}", "r" * 300, "\n" * 40, "😀" * 20]  # fmt: skip
TEMPLATES = ["{{ messages[0].content }}", "{% for m in messages %}{{ m.content }}{% endfor %}", "{{ 1/0 }}"]


def message_class(desc: Descriptor) -> type[Message]:
    return getattr(MODULES[desc.file.package], desc.name)  # type: ignore[no-any-return]


class Fuzzer:
    """Builds cases from one seeded `random.Random`."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def scalar(self, field: FieldDescriptor) -> Any:
        r, t = self.rng, field.type
        if t == FieldDescriptor.TYPE_BOOL:
            return r.random() < 0.5
        if t == FieldDescriptor.TYPE_STRING:
            return (
                r.choice(STRINGS)
                if r.random() < 0.7
                else "".join(chr(r.randint(1, 0xD7FF)) for _ in range(r.randint(1, 64)))
            )
        if t == FieldDescriptor.TYPE_BYTES:
            return r.randbytes(r.randint(0, 32))
        if t in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
            return r.choice(FLOATS) if r.random() < 0.7 else r.uniform(-10, 10)
        if t == FieldDescriptor.TYPE_ENUM:
            values = [v.number for v in field.enum_type.values]
            return r.choice(values) if r.random() < 0.7 else r.randint(0, 2**31 - 1)
        unsigned = t in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED32,
                         FieldDescriptor.TYPE_FIXED64)  # fmt: skip
        bits = (
            64
            if t in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_FIXED64)
            else 32
        )
        value = r.choice(INTS) if r.random() < 0.6 else r.randint(0, 300)
        if unsigned:
            return value % 2**bits
        return max(min(value, 2 ** (bits - 1) - 1), -(2 ** (bits - 1)))

    def kwargs(self, struct: struct_pb2.Struct) -> None:
        r = self.rng
        items: dict[str, Any] = {
            r.choice(["x", "tools", "enable_thinking", "tokenize", "date"]): r.choice([1, "a", True, None])
        }
        if r.random() < 0.3:
            items["chat_template"] = r.choice(TEMPLATES)
        struct.update(items)

    def fill(self, msg: Message, depth: int = 0) -> None:
        """Set a random subset of `msg`'s fields (recursively) to edge values."""
        r = self.rng
        for field in msg.DESCRIPTOR.fields:
            if r.random() > 0.45:
                continue
            if field.message_type is not None and field.message_type.full_name == "google.protobuf.Struct":
                self.kwargs(getattr(msg, field.name))
            elif field.message_type is not None:
                if depth > 3:
                    continue
                if field.is_repeated:
                    container = getattr(msg, field.name)
                    for _ in range(r.choice([0, 1, 2, 5])):
                        self.fill(container.add(), depth + 1)
                else:
                    sub = getattr(msg, field.name)
                    sub.SetInParent()
                    self.fill(sub, depth + 1)
            elif field.is_repeated:
                n = r.choice([0, 1, 3, 70, 2000]) if r.random() < 0.9 else 20_000
                getattr(msg, field.name).extend(self.scalar(field) for _ in range(n))
            else:
                setattr(msg, field.name, self.scalar(field))

    def request(self, method: MethodDescriptor) -> Message:
        msg = message_class(method.input_type)()
        if method.name in ("Generate", "Chat") and self.rng.random() < 0.5:
            msg.CopyFrom(greedy("fuzz", max_tokens=2) if method.name == "Generate" else pb.ChatRequest(
                messages=[pb.ChatMessage(role="user", content="fuzz")]))  # fmt: skip
        self.fill(msg)
        return msg

    def raw(self, method: MethodDescriptor) -> bytes:
        r = self.rng
        if r.random() < 0.4:
            return r.randbytes(r.randint(0, 200))
        data = bytearray(self.request(method).SerializeToString())
        for _ in range(r.randint(1, 4)):
            op = r.random()
            if op < 0.4 and data:
                data[r.randrange(len(data))] = r.randrange(256)
            elif op < 0.7 and data:
                del data[r.randrange(len(data)) :]
            else:
                data += r.randbytes(r.randint(1, 8))
        return bytes(data)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Mostly the fuzz key (so cases get past authentication), else the admin key or junk."""
        if self.rng.random() < 0.7:
            return (("authorization", f"Bearer {FUZZ_KEY}"),)
        key = self.rng.choice([FUZZ_KEY, ADMIN_KEY, CANARY_KEY + "x", None, "~!@#"])
        if key is None:
            return ()
        return (("authorization", self.rng.choice(["Bearer ", "bearer ", "Basic ", ""]) + key),)


async def call(
    channel: grpc.aio.Channel, method: MethodDescriptor, payload: bytes, md: Any
) -> grpc.StatusCode:
    """One raw-bytes call of `method`; its final status code."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    timeout = 0.5 if method.name in ("GetPoolState", "Watch") else 3.0
    try:
        if method.server_streaming:
            async for _ in channel.unary_stream(path)(payload, timeout=timeout, metadata=md):
                pass
        else:
            await channel.unary_unary(path)(payload, timeout=timeout, metadata=md)
    except grpc.aio.AioRpcError as err:
        return err.code()
    return grpc.StatusCode.OK


async def answer_prefills(p: ScriptedWorker, canary: asyncio.Future[Any]) -> None:
    """The prefill worker: every fuzz request gets one token and LENGTH; the canary's is kept open."""
    while True:
        req = (await p.expect("prefill", timeout=3600)).prefill.request
        p.inbox.clear()  # aborts, queries: nothing to answer
        if req.request_id == CANARY and not canary.done():
            canary.set_result(req)
            continue
        await p.tokens(req.rid, req.generation, 0, [1], pb.FINISH_REASON_LENGTH, prefill_done=True)


async def test_api_fuzz_never_unknown_or_internal_and_the_canary_is_unharmed(
    start_cluster: StartCluster,
) -> None:
    # the scripted workers do not heartbeat: keep them fresh for the whole run
    cluster = await start_cluster(
        api_keys=(FUZZ_KEY, CANARY_KEY), max_queue=64, heartbeat_timeout_ms=3_600_000
    )
    p, d = await cluster.ready_pair()
    canary_req: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    responder = asyncio.create_task(answer_prefills(p, canary_req))
    canary_md = (("authorization", f"Bearer {CANARY_KEY}"),)
    canary = cluster.inference.Generate(greedy("canary", max_tokens=3, request_id=CANARY), metadata=canary_md)
    req = await asyncio.wait_for(canary_req, 10)
    await p.tokens(req.rid, req.generation, 0, [11], prefill_done=True)
    await d.tokens(req.rid, req.generation, 0, [11])  # D's first step: token 1 streams
    assert list((await canary.read()).delta.token_ids) == [11]

    fuzz = Fuzzer(random.Random(SEED))
    seen: dict[grpc.StatusCode, int] = {}
    try:
        for start in range(0, CASES, BATCH):
            cases = []
            for i in range(start, min(start + BATCH, CASES)):
                method = fuzz.rng.choice(METHODS)
                structured = fuzz.rng.random() < 0.6
                payload = fuzz.request(method).SerializeToString() if structured else fuzz.raw(method)
                cases.append((i, method, call(cluster.channel, method, payload, fuzz.metadata())))
            codes = await asyncio.gather(*(c for _, _, c in cases))
            for (i, method, _), code in zip(cases, codes, strict=True):
                seen[code] = seen.get(code, 0) + 1
                assert code not in FORBIDDEN, f"case {i} (seed {SEED}): {method.full_name} ended {code.name}"
            assert not cluster.app.plane_task.done(), "the control plane stopped"
    finally:
        responder.cancel()
    assert len(seen) >= 4, seen  # the cases reached more than one kind of answer

    await d.tokens(req.rid, req.generation, 1, [12, 13], finish=pb.FINISH_REASON_LENGTH)
    rest = await collect(canary)
    assert [i for r in rest if r.HasField("delta") for i in r.delta.token_ids] == [12, 13]
    assert rest[-1].finished.reason == pb.FINISH_REASON_LENGTH
