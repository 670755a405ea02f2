"""Fixtures for the coordinator tests: the served tiny model (tokenizer only), an in-process
coordinator on OS-chosen ports, and scripted workers speaking control.proto over real sockets."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import zmq.asyncio

from coordinator.app import Coordinator, CoordinatorConfig
from coordinator.served_model import ServedModel, load_served_model
from tests.coordinator.peer import ScriptedWorker


@pytest.fixture(scope="session")
def served_model(tiny_model_dir: Callable[[str], Path]) -> ServedModel:
    return load_served_model(str(tiny_model_dir("llama-2l")), "tiny")


class Cluster:
    """A started coordinator, a gRPC channel to it, and a factory of scripted workers."""

    def __init__(self, app: Coordinator, model: ServedModel) -> None:
        self.app = app
        self.model = model
        self.channel = grpc.aio.insecure_channel(app.grpc_address)
        self.zmq = zmq.asyncio.Context()
        self.workers: list[ScriptedWorker] = []

    def worker(self, worker_id: str, role: str, **kwargs: Any) -> ScriptedWorker:
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
        for w in self.workers:
            w.close()
        self.zmq.term()


@pytest.fixture
async def start_cluster(served_model: ServedModel) -> AsyncIterator[Callable[..., Awaitable[Cluster]]]:
    """`await start_cluster(**config_overrides)` -> a Cluster; everything is closed after the test."""
    clusters: list[Cluster] = []

    async def start(**overrides: Any) -> Cluster:
        config = CoordinatorConfig(
            model="tiny", port=0, control_port=0, metrics_port=0, heartbeat_interval_ms=100,
            heartbeat_timeout_ms=5000, **overrides,
        )  # fmt: skip
        app = Coordinator(config, model=served_model)
        await app.start()
        clusters.append(Cluster(app, served_model))
        return clusters[-1]

    yield start
    for cluster in clusters:
        await cluster.close()
        await cluster.app.stop()
