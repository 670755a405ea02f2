"""A scripted worker: plays a prefill, decode or colocated worker's side of control.proto over a real
ZeroMQ DEALER, so the coordinator under test talks to exactly what it talks to in production."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import zmq.asyncio

from coordinator.served_model import ServedModel
from splitserve.control import ControlSocket, CurveKeys, envelope
from splitserve.v1 import control_pb2, serving_pb2
from splitserve.wire import pack_hashes, pack_ids

ROLES = {
    "prefill": serving_pb2.WORKER_ROLE_PREFILL,
    "decode": serving_pb2.WORKER_ROLE_DECODE,
    "colocated": serving_pb2.WORKER_ROLE_COLOCATED,
}


class ScriptedWorker:
    """One worker identity. `expect(kind)` returns the next message of that kind; Peers broadcasts and
    other kinds received meanwhile are kept (see `inbox`) for later `expect` calls."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        coordinator: str,
        worker_id: str,
        role: str,
        model: ServedModel,
        *,
        num_blocks: int = 64,
        block_size: int = 16,
        layout_hash: str = "layout-a",
        identity: str | None = None,
        keys: CurveKeys | None = None,
        server_key: bytes | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.role = ROLES[role]
        self.model = model
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.layout_hash = layout_hash
        self.identity = identity or model.identity
        self.public_key = keys.public.decode() if keys is not None else ""
        self.sock = ControlSocket.dealer(
            ctx, coordinator, identity=worker_id, keys=keys, server_key=server_key
        )
        self.inbox: list[control_pb2.Envelope] = []
        self.heartbeat_seq = 0

    @property
    def endpoint(self) -> control_pb2.WorkerEndpoint:
        return control_pb2.WorkerEndpoint(
            worker_id=self.worker_id,
            control_address=f"tcp://127.0.0.1:1/{self.worker_id}",
            transfer_address=f"127.0.0.1:2/{self.worker_id}",
        )

    async def send(self, **msg: Any) -> None:
        await self.sock.send(envelope(**msg))

    async def register(self, timeout: float = 5.0) -> control_pb2.RegisterAck:
        layout = control_pb2.KvLayout(
            dtype="float32", num_layers=2, block_size=self.block_size, num_kv_heads=2, head_dim=16,
            order="block_major", hash=self.layout_hash,
        )  # fmt: skip
        await self.send(
            register=control_pb2.Register(
                protocol_version=control_pb2.PROTOCOL_VERSION_1,
                role=self.role,
                endpoint=self.endpoint,
                incarnation=7,
                model=self.model.name,
                model_identity=self.identity,
                context_length=self.model.context_length,
                kv_layout=layout,
                num_blocks=self.num_blocks,
                transfer_backend="tcp",
            )
        )
        return (await self.expect("register_ack", timeout)).register_ack

    async def heartbeat(
        self,
        *,
        free_blocks: int | None = None,
        queued_tokens: int = 0,
        us_per_token: float = 0.0,
        stored_hashes: Sequence[int] = (),
    ) -> None:
        self.heartbeat_seq += 1
        free = self.num_blocks if free_blocks is None else free_blocks
        pool = serving_pb2.KvPoolState(
            total_blocks=self.num_blocks, block_size=self.block_size, free_blocks=free,
            held_blocks=self.num_blocks - free,
        )  # fmt: skip
        load = serving_pb2.WorkerLoad(queued_tokens=queued_tokens, prefill_us_per_token=us_per_token)
        events = control_pb2.PrefixCacheEvents(stored=pack_hashes(list(stored_hashes)))
        await self.send(
            heartbeat=control_pb2.Heartbeat(
                worker_id=self.worker_id, incarnation=7, seq=self.heartbeat_seq,
                health=serving_pb2.WORKER_HEALTH_READY, load=load, pool=pool, prefix_cache=events,
            )
        )  # fmt: skip

    async def expect(self, kind: str, timeout: float = 5.0) -> control_pb2.Envelope:
        """The next `kind` message: from the inbox first, else waited for (bounded)."""
        for i, env in enumerate(self.inbox):
            if env.WhichOneof("msg") == kind:
                return self.inbox.pop(i)
        async with asyncio.timeout(timeout):
            while True:
                env = (await self.sock.recv()).envelope
                if env.WhichOneof("msg") == kind:
                    return env
                self.inbox.append(env)

    async def tokens(
        self,
        rid: int,
        generation: int,
        offset: int,
        ids: Sequence[int],
        finish: serving_pb2.FinishReason.ValueType = serving_pb2.FINISH_REASON_UNSPECIFIED,
        *,
        prefill_done: bool = False,
    ) -> None:
        """Send output tokens: as PrefillDone when `prefill_done`, else as a one-item TokenBatch."""
        item = control_pb2.Tokens(
            rid=rid, generation=generation, offset=offset, token_ids=pack_ids(list(ids)), finish_reason=finish
        )
        if prefill_done:
            done = control_pb2.PrefillDone(
                output=item, cached_tokens=0, computed_tokens=3, queue_ms=1.5, prefill_ms=2.5
            )
            await self.send(prefill_done=done)
        else:
            await self.send(token_batch=control_pb2.TokenBatch(worker_id=self.worker_id, items=[item]))

    def close(self) -> None:
        self.sock.close()
