"""The state a role keeps for one request (subclassed by PrefillJob and DecodeRequest)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from engine.sequence import Sequence
from splitserve.v1 import control_pb2


@dataclass(slots=True, eq=False)
class WorkerRequest:
    """A worker role's state for one (rid, generation) (the coordinator's record of the request is
    `coordinator.request_table.RequestRecord`). `peer` is the other worker of the transfer (P's decode
    worker, D's prefill worker; None when D prefills locally). Timers are disarmed by `_end`."""

    req: control_pb2.ExecutionRequest
    seq: Sequence
    peer: control_pb2.WorkerEndpoint | None
    log: Any
    arrived: float = field(default_factory=time.monotonic)
    started: float | None = None
    lease: asyncio.TimerHandle | None = None
    deadline: asyncio.TimerHandle | None = None
    num_kv_tokens: int = field(init=False)  # prompt + output at arrival: the KV a prefill produces

    def __post_init__(self) -> None:
        self.num_kv_tokens = self.seq.num_tokens

    @property
    def rid(self) -> int:
        return self.req.rid

    @property
    def generation(self) -> int:
        return self.req.generation

    def disarm(self) -> None:
        for timer in (self.lease, self.deadline):
            if timer is not None:
                timer.cancel()
        self.lease = self.deadline = None
