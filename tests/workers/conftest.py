"""Worker fixtures: real workers (engine, sockets, step threads) in this process, on 127.0.0.1 with
OS-chosen ports, driven by `ScriptedCoordinator`, a ZeroMQ ROUTER that plays the coordinator's side of
control.proto (register, dispatch, collect). The model is loaded once per session and shared read-only.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import zmq.asyncio

from decode.worker import DecodeWorker
from engine.config import EngineConfig
from engine.llm import LLM
from engine.loader import LoadedModel, load_model
from engine.sampling_params import SamplingParams
from engine.worker.process import Worker
from engine.worker.settings import WorkerSettings
from prefill.worker import PrefillWorker
from splitserve import wire
from splitserve.control import ControlSocket, envelope
from splitserve.control_auth import AuthorizedKeys, KeySet, ZapHandler, load_keys
from splitserve.v1 import control_pb2

WAIT_S = 20.0  # bound of every wait for a message in these tests


@pytest.fixture(scope="session")
def model_dir(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir("llama-2l")


@pytest.fixture(scope="session")
def loaded(model_dir: Path) -> LoadedModel:
    return load_model(model_dir)


@pytest.fixture(scope="session")
def greedy(model_dir: Path) -> Callable[[list[int], int], list[int]]:
    """The offline engine's greedy continuation (itself checked against transformers elsewhere)."""
    llm = LLM(model_dir, block_size=4, num_blocks=256)

    def run(prompt: list[int], n: int) -> list[int]:
        return llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[
            0
        ].token_ids

    return run


class ScriptedCoordinator:
    """The coordinator's side of the protocol, scripted by a test. Accepts every Register from a key
    in `keys`, sends each worker the current peers (and everyone a Peers update), and files every other
    message by kind."""

    def __init__(self, keys: KeySet) -> None:
        self.keys = keys
        self.ctx = zmq.asyncio.Context()
        self.auth = ZapHandler(self.ctx, AuthorizedKeys(keys.authorized_dir).__contains__).start()
        self.router = ControlSocket.router(
            self.ctx, "tcp://127.0.0.1:0", keys=load_keys(keys.coordinator_secret)
        )
        self.address = self.router.address.removeprefix("tcp://")
        self.workers: dict[str, control_pb2.Register] = {}
        self.inbox: dict[str, asyncio.Queue[tuple[str, control_pb2.Envelope]]] = defaultdict(asyncio.Queue)
        self._filed = asyncio.Event()  # set whenever a message lands in an inbox
        self._ids = itertools.count(1)
        self._task = asyncio.create_task(self._serve())

    def peers(self) -> list[control_pb2.Peer]:
        return [
            control_pb2.Peer(
                role=r.role, endpoint=r.endpoint, incarnation=r.incarnation, kv_layout_hash=r.kv_layout.hash
            )
            for r in self.workers.values()
        ]

    async def _serve(self) -> None:
        while True:
            got = await self.router.recv()
            if got.kind == "register":
                self.workers[got.sender] = got.envelope.register
                ack = control_pb2.RegisterAck(accepted=True, heartbeat_interval_ms=200, peers=self.peers())
                await self.router.send(envelope(register_ack=ack), to=got.sender)
                for wid in self.workers:
                    if wid != got.sender:
                        await self.send(wid, peers=control_pb2.Peers(peers=self.peers()))
            else:  # outputs share one FIFO ("output") so their order across kinds is kept
                kind = "output" if got.kind in ("prefill_done", "token_batch", "preempted") else got.kind
                self.inbox[kind].put_nowait((got.sender, got.envelope))
                self._filed.set()

    async def send(self, worker_id: str, **msg: Any) -> None:
        await self.router.send(envelope(**msg), to=worker_id)

    async def expect(self, kind: str, timeout: float = WAIT_S) -> tuple[str, control_pb2.Envelope]:
        """The next message of `kind` (bounded wait)."""
        return await self.expect_first(kind, timeout=timeout)

    async def expect_first(self, *kinds: str, timeout: float = WAIT_S) -> tuple[str, control_pb2.Envelope]:
        """The next message of any of `kinds` (bounded wait). Unlike racing one `expect` per kind and
        cancelling the losers, it never takes a message off a queue without returning it."""
        deadline = time.monotonic() + timeout
        while True:
            self._filed.clear()  # before looking: a message filed after the look sets it again
            for kind in kinds:
                if not self.inbox[kind].empty():
                    return self.inbox[kind].get_nowait()
            await asyncio.wait_for(self._filed.wait(), max(0.0, deadline - time.monotonic()))

    async def collect(self, rids: set[int]) -> dict[int, tuple[list[int], int]]:
        """Gather PrefillDone and TokenBatch output until every rid finished: rid -> (tokens, finish).
        Asserts each request's offsets are contiguous (no gap, no duplicate but a decode worker's one
        announce of a shipped token 1 at its first step, which repeats the last token)."""
        tokens: dict[int, list[int]] = {rid: [] for rid in rids}
        base: dict[int, int] = {}
        finished: dict[int, int] = {}
        announced: set[int] = set()
        while set(finished) != rids:
            _, env = await self.expect("output")
            items = [env.prefill_done.output] if env.HasField("prefill_done") else list(env.token_batch.items)
            for item in items:
                assert item.rid in rids and item.rid not in finished, f"unexpected output for {item.rid}"
                start = base.setdefault(item.rid, item.offset)
                have = tokens[item.rid]
                repeat = item.offset == start + len(have) - 1 and wire.unpack_ids(item.token_ids) == have[-1:]
                if repeat and not item.finish_reason and item.rid not in announced:
                    announced.add(item.rid)
                    continue
                assert item.offset == start + len(have), "offset gap or duplicate"
                tokens[item.rid] += wire.unpack_ids(item.token_ids)
                if item.finish_reason:
                    finished[item.rid] = item.finish_reason
        return {rid: (tokens[rid], finished[rid]) for rid in rids}

    async def pool_state(self, worker_id: str) -> control_pb2.PoolStateReply:
        qid = next(self._ids)
        await self.send(
            worker_id, pool_state_query=control_pb2.PoolStateQuery(query_id=qid, check_integrity=True)
        )
        while True:
            _, env = await self.expect("pool_state_reply")
            if env.pool_state_reply.query_id == qid:
                return env.pool_state_reply

    async def assert_pool_clean(self, worker_id: str) -> control_pb2.PoolStateReply:
        """Integrity holds and no block is held (free or kept by the prefix cache only).

        Releases finish asynchronously (after the in-flight step, after a session's receives end), so
        this polls under a deadline rather than asserting the first answer.
        """
        deadline = time.monotonic() + WAIT_S
        reply = await self.pool_state(worker_id)
        while reply.pool.held_blocks and time.monotonic() < deadline:
            await asyncio.sleep(0.02)  # poll interval of a bounded wait
            reply = await self.pool_state(worker_id)
        pool = reply.pool
        assert pool.integrity_ok, pool.integrity_error
        assert pool.held_blocks == 0, f"{worker_id} holds {pool.held_blocks} blocks"
        assert pool.free_blocks + pool.cached_blocks == pool.total_blocks
        return reply

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self.router.close()
        self.auth.stop()
        self.ctx.term()


def endpoint(worker: Worker) -> control_pb2.WorkerEndpoint:
    assert worker.control is not None
    return worker.control.endpoint


def execution_request(
    rid: int,
    prompt: list[int],
    max_tokens: int,
    *,
    generation: int = 1,
    output: list[int] | None = None,
    identity: str = "",
    ignore_eos: bool = True,
    temperature: float = 0.0,
    seed: int = 0,
) -> control_pb2.ExecutionRequest:
    return control_pb2.ExecutionRequest(
        rid=rid,
        generation=generation,
        request_id=f"req-{rid}",
        model="tiny",
        model_identity=identity,
        prompt_token_ids=wire.pack_ids(prompt),
        output_token_ids=wire.pack_ids(output or []),
        sampling=control_pb2.Sampling(temperature=temperature, top_p=1.0, repetition_penalty=1.0, seed=seed),
        stopping=control_pb2.Stopping(max_tokens=max_tokens, ignore_eos=ignore_eos),
    )


class Cluster:
    """Workers started against one ScriptedCoordinator; `close()` stops them all."""

    def __init__(self, coordinator: ScriptedCoordinator, loaded: LoadedModel, backend: str = "tcp") -> None:
        self.coordinator = coordinator
        self.loaded = loaded
        self.backend = backend
        self.workers: dict[str, Worker] = {}

    async def start(
        self,
        role: str,
        worker_id: str,
        *,
        lease_ms: int = 10_000,
        queue_lease_ms: int = 120_000,
        kv_blocks_per_message: int = 0,
        max_prompt_tokens: int = 0,
        **engine: Any,
    ) -> Worker:
        """Start a worker; `kv_blocks_per_message` > 0 makes kvtransfer split the KV into messages of
        that many blocks (sent direct when the reserved ids are consecutive); `max_prompt_tokens` is a
        prefill worker's lane."""
        engine.setdefault("block_size", 4)
        engine.setdefault("num_blocks", 64)
        settings = WorkerSettings(
            role=role,
            model="tiny",
            coordinator=self.coordinator.address,
            worker_id=worker_id,
            engine=EngineConfig(**engine),
            transfer_backend=self.backend,
            lease_ms=lease_ms,
            queue_lease_ms=queue_lease_ms,
            max_prompt_tokens=max_prompt_tokens,
            drain_timeout_s=5.0,
            register_timeout_s=WAIT_S,
            control_key=str(self.coordinator.keys.add_worker(worker_id, role)),
            coordinator_public_key=str(self.coordinator.keys.coordinator_public),
        )
        if kv_blocks_per_message:
            cfg = self.loaded.config  # float32 blocks: layers x K/V x block_size x kv heads x head_dim
            block_bytes = (
                cfg.num_hidden_layers * 2 * engine["block_size"] * cfg.num_key_value_heads * cfg.head_dim * 4
            )
            settings.kv_message_bytes = settings.kv_direct_bytes = kv_blocks_per_message * block_bytes
        worker = Worker(settings, self.loaded, PrefillWorker if role == "prefill" else DecodeWorker)
        self.workers[worker_id] = worker
        await worker.start()
        return worker

    async def close(self) -> None:
        for worker in self.workers.values():
            await worker.close()


@pytest.fixture
async def cluster(loaded: LoadedModel, tmp_path: Path) -> AsyncIterator[Cluster]:
    coordinator = ScriptedCoordinator(KeySet.create(tmp_path / "keys"))
    c = Cluster(coordinator, loaded)
    try:
        yield c
    finally:
        await c.close()
        await coordinator.close()
