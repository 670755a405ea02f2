"""Fixtures for the coordinator tests: the served tiny model (tokenizer only), an in-process
coordinator on OS-chosen ports, and scripted workers speaking control.proto over real sockets."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import zmq.asyncio

from coordinator.admission import AdmittedRequest
from coordinator.app import Coordinator, CoordinatorConfig
from coordinator.router import Router
from coordinator.routing_policy import RoutingPolicy
from coordinator.served_model import ServedModel, load_served_model
from coordinator.workers import WorkerInfo, WorkerRegistry
from engine.sampling_params import SamplingParams
from splitserve.control_auth import KeySet, load_public_key
from splitserve.v1 import control_pb2, serving_pb2, serving_pb2_grpc
from splitserve.wire import pack_hashes
from tests.coordinator.peer import ROLES, ScriptedWorker


@pytest.fixture(scope="session")
def served_model(tiny_model_dir: Callable[[str], Path]) -> ServedModel:
    return load_served_model(str(tiny_model_dir("llama-2l")), "tiny")


class Pool:
    """A registry of workers built from real Register/Heartbeat messages."""

    def __init__(self, model: ServedModel, policy: RoutingPolicy | None = None) -> None:
        self.model = model
        self.registry = WorkerRegistry(model, heartbeat_timeout_s=3.0)
        self.router = Router(self.registry, policy)

    def add(
        self,
        worker_id: str,
        role: str,
        num_blocks: int = 64,
        layout: str = "a",
        block_size: int = 16,
        **lane: Any,
    ) -> WorkerInfo:
        """Register a worker; `lane` sets Register's max_prompt_tokens / idle_priority."""
        reg = control_pb2.Register(
            protocol_version=control_pb2.PROTOCOL_VERSION_1,
            role=ROLES[role],
            endpoint=control_pb2.WorkerEndpoint(worker_id=worker_id),
            incarnation=1,
            model=self.model.name,
            model_identity=self.model.identity,
            context_length=self.model.context_length,
            kv_layout=control_pb2.KvLayout(block_size=block_size, hash=layout),
            num_blocks=num_blocks,
            **lane,
        )
        assert self.registry.refusal(worker_id, reg) is None
        return self.registry.add(reg, now=0.0)[0]

    def pair(self, decode_free: int | None = None) -> None:
        """Prefill worker "p" and decode worker "d", the latter reporting `decode_free` free blocks."""
        self.add("p", "prefill")
        self.add("d", "decode")
        if decode_free is not None:
            self.report("d", free=decode_free)

    def report(
        self,
        worker_id: str,
        *,
        free: int | None = None,
        queued_tokens: int = 0,
        us_per_token: float = 0.0,
        stored: list[int] | None = None,
        seq: int | None = None,
        now: float = 0.0,
        **load: Any,
    ) -> None:
        """A heartbeat; `load` sets more WorkerLoad fields (step_token_budget, decode_step_ms, ...)."""
        info = self.registry.get(worker_id)
        assert info is not None
        n = info.register.num_blocks
        hb = control_pb2.Heartbeat(
            worker_id=worker_id,
            incarnation=1,
            seq=info.heartbeat_seq + 1 if seq is None else seq,
            load=serving_pb2.WorkerLoad(
                queued_tokens=queued_tokens, prefill_us_per_token=us_per_token, **load
            ),
            pool=serving_pb2.KvPoolState(total_blocks=n, free_blocks=n if free is None else free),
            prefix_cache=control_pb2.PrefixCacheEvents(stored=pack_hashes(stored or [])),
        )
        assert self.registry.heartbeat(worker_id, hb, now) is not None


@pytest.fixture
def pool(served_model: ServedModel) -> Pool:
    return Pool(served_model)


def document_on_p_pool(served_model: ServedModel) -> Pool:
    """Conditional with prompts up to 2,048 tokens allowed on D: P prefilling a 1,000-token document
    under threshold 256 (1.25 ms a token, 5 ms a step), D registered with 1,000 blocks, not reported."""
    pool = Pool(served_model, RoutingPolicy("conditional", local_prefill_max_tokens=2048))
    pool.add("p", "prefill")
    pool.add("d", "decode", num_blocks=1000)
    pool.report(
        "p", queued_tokens=1000, queued_long_tokens=1000, long_prefill_token_threshold=256,
        step_token_budget=2048, step_base_ms=5.0, us_per_token=1250.0,
    )  # fmt: skip
    return pool


def make_admitted(
    model: ServedModel, prompt: str = "hello world", request_id: str = "r", priority: int = 0, **params: Any
) -> AdmittedRequest:
    """An admitted request as admission would produce it (seeded, max_tokens resolved)."""
    params.setdefault("seed", 1)
    params.setdefault("max_tokens", 8)
    ids = model.tokenizer.encode(prompt)
    return AdmittedRequest(
        request_id=request_id,
        model=model,
        prompt_token_ids=ids,
        params=SamplingParams(**params),
        priority=priority,
    )


ADMIN_KEY = "admin-test"


class WithMetadata(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Adds fixed metadata (an API key) to every unary call of a channel."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.metadata = metadata

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        details = details._replace(metadata=(*(details.metadata or ()), *self.metadata))
        return await continuation(details, request)


class Cluster:
    """A started coordinator, a gRPC channel to it, and a factory of scripted workers (each with its
    own control key, allow-listed for its role in `keys`). `admin` calls carry the admin key (the
    fixture configures ADMIN_KEY unless a test overrides admin_keys)."""

    def __init__(self, app: Coordinator, model: ServedModel, keys: KeySet) -> None:
        self.app = app
        self.model = model
        self.keys = keys
        self.channel = grpc.aio.insecure_channel(app.grpc_address)
        admin_md = (("authorization", f"Bearer {ADMIN_KEY}"),)
        self.admin_channel = grpc.aio.insecure_channel(
            app.admin_address or app.grpc_address, interceptors=[WithMetadata(admin_md)]
        )
        self.zmq = zmq.asyncio.Context()
        self.workers: list[ScriptedWorker] = []
        self.inference = serving_pb2_grpc.InferenceServiceStub(self.channel)
        self.admin = serving_pb2_grpc.AdminServiceStub(self.admin_channel)

    def worker(self, worker_id: str, role: str, **kwargs: Any) -> ScriptedWorker:
        if worker_id not in self.keys.workers:
            self.keys.add_worker(worker_id, role)
        kwargs.setdefault("keys", self.keys.worker_keys(worker_id))
        kwargs.setdefault("server_key", load_public_key(self.keys.coordinator_public))
        w = ScriptedWorker(self.zmq, self.app.control_address, worker_id, role, self.model, **kwargs)
        self.workers.append(w)
        return w

    async def ready_pair(self, **decode_kwargs: Any) -> tuple[ScriptedWorker, ScriptedWorker]:
        """A registered prefill worker "p0" and decode worker "d0"."""
        p, d = self.worker("p0", "prefill"), self.worker("d0", "decode", **decode_kwargs)
        assert (await p.register()).accepted and (await d.register()).accepted
        return p, d

    async def close(self) -> None:
        await self.channel.close()
        await self.admin_channel.close()
        for w in self.workers:
            w.close()
        self.zmq.term()


@pytest.fixture
async def start_cluster(
    served_model: ServedModel, tmp_path: Path
) -> AsyncIterator[Callable[..., Awaitable[Cluster]]]:
    """`await start_cluster(**config_overrides)` -> a Cluster; everything is closed after the test."""
    clusters: list[Cluster] = []

    async def start(**overrides: Any) -> Cluster:
        keys = KeySet.create(tmp_path / f"keys-{len(clusters)}")
        settings: dict[str, Any] = {
            "heartbeat_interval_ms": 100,
            "heartbeat_timeout_ms": 5000,
            "control_key": str(keys.coordinator_secret),
            "control_authorized_keys": str(keys.authorized_dir),
            "admin_keys": (ADMIN_KEY,),
        } | overrides
        config = CoordinatorConfig(model="tiny", port=0, control_port=0, metrics_port=0, **settings)
        app = Coordinator(config, model=served_model)
        await app.start()
        clusters.append(Cluster(app, served_model, keys))
        return clusters[-1]

    yield start
    for cluster in clusters:
        await cluster.close()
        await cluster.app.stop()
