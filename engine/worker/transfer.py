"""The worker's side of the bulk data plane: kvtransfer's listener over this worker's KV cache tensor.

kvtransfer owns the transport (UCX or TCP), the layout descriptor and the transfer sessions; this module
only creates them for a worker and hands the prefill role a shipper and the decode role a receiver.
"""

from __future__ import annotations

import hashlib

from engine.llm_engine import LLMEngine
from engine.worker.metrics import WorkerMetrics
from engine.worker.settings import WorkerSettings
from splitserve.v1 import control_pb2


class TransferPlane:
    """Created by the worker before it registers (its address goes into Register); closed last."""

    def __init__(self, settings: WorkerSettings, engine: LLMEngine, address: str) -> None:
        self.settings = settings
        self.engine = engine
        self.address = address

    @classmethod
    async def listen(cls, settings: WorkerSettings, engine: LLMEngine) -> TransferPlane:
        raise NotImplementedError("waiting for kvtransfer's transport API")

    @staticmethod
    def kv_layout(engine: LLMEngine) -> control_pb2.KvLayout:
        cache = engine.runner.kv_cache
        _, num_layers, _, block_size, num_kv_heads, head_dim = cache.shape
        layout = control_pb2.KvLayout(
            dtype=str(cache.dtype).removeprefix("torch."),
            num_layers=num_layers,
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            order="block_major",
        )
        text = f"{layout.SerializeToString(deterministic=True).hex()}:{engine.loaded.identity}"
        layout.hash = hashlib.sha256(text.encode()).hexdigest()
        return layout

    def shipper(self, metrics: WorkerMetrics) -> object:
        raise NotImplementedError

    def receiver(self, metrics: WorkerMetrics) -> object:
        raise NotImplementedError

    async def close(self) -> None:
        return None
