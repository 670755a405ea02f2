"""The worker registry: who is registered, what each last reported, and who is fresh enough for new work.

Fed by the control loop (Register, Heartbeat, Deregister, PoolStateReply) and read by the router, the
health service and AdminService. Load and health are the workers' reports, cached with a timestamp:
a worker whose last message is older than the staleness bound is STALE and receives no new work until it
heartbeats again. Between reports the registry adds what the coordinator itself sent since (pending
decode blocks and prefill tokens), so a burst of placements does not all land on one worker.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import structlog

from coordinator.served_model import ServedModel
from splitserve.v1 import control_pb2, serving_pb2
from splitserve.wire import unpack_hashes

PREFILL, DECODE, COLOCATED = (
    serving_pb2.WORKER_ROLE_PREFILL,
    serving_pb2.WORKER_ROLE_DECODE,
    serving_pb2.WORKER_ROLE_COLOCATED,
)
READY, DRAINING, STALE = (
    serving_pb2.WORKER_HEALTH_READY,
    serving_pb2.WORKER_HEALTH_DRAINING,
    serving_pb2.WORKER_HEALTH_STALE,
)
_LAYOUT_FIELDS = ("dtype", "num_layers", "block_size", "num_kv_heads", "head_dim", "order")

log = structlog.get_logger(__name__)


@dataclass(slots=True, eq=False)
class WorkerInfo:
    """One registered worker incarnation. Created by `WorkerRegistry.add`; changed only by the registry
    (reports) and the router (pending work it placed, how far its long prompts' estimates missed)."""

    register: control_pb2.Register
    last_seen: float
    health: serving_pb2.WorkerHealth.ValueType = READY
    heartbeat_seq: int = 0
    load: serving_pb2.WorkerLoad = field(default_factory=serving_pb2.WorkerLoad)
    pool: serving_pb2.KvPoolState = field(default_factory=serving_pb2.KvPoolState)
    prefix_hashes: set[int] = field(default_factory=set)
    pending_blocks: int = 0  # decode blocks placed here since the last report
    pending_tokens: int = 0  # uncached prefill tokens placed here since the last report
    pending_long_tokens: int = 0  # of those, prompts over its long_prefill_token_threshold
    # path -> (when, observed / estimated) of its last long prompts' first tokens (ttft_calibration.py)
    long_ttft_ratios: dict[int, deque[tuple[float, float]]] = field(default_factory=dict)
    load_refused: str | None = None  # why its last report's load was not applied (`load_refusal`)

    def __post_init__(self) -> None:
        n = self.register.num_blocks
        self.pool = serving_pb2.KvPoolState(total_blocks=n, block_size=self.block_size, free_blocks=n)

    @property
    def worker_id(self) -> str:
        return self.register.endpoint.worker_id

    @property
    def role(self) -> serving_pb2.WorkerRole.ValueType:
        return self.register.role

    @property
    def role_name(self) -> str:
        return serving_pb2.WorkerRole.Name(self.role).removeprefix("WORKER_ROLE_").lower()

    @property
    def block_size(self) -> int:
        return self.register.kv_layout.block_size or 1

    @property
    def layout_hash(self) -> str:
        return self.register.kv_layout.hash

    @property
    def does_prefill(self) -> bool:
        return self.role in (PREFILL, COLOCATED)

    @property
    def does_decode(self) -> bool:
        return self.role in (DECODE, COLOCATED)

    @property
    def idle_priority(self) -> bool:
        """A prefill worker at SCHED_IDLE (`--cpu-priority idle`): the lane of last resort."""
        return self.register.idle_priority

    def takes_sequence(self, num_tokens: int) -> bool:
        """Whether its lane (`--max-prompt-tokens`, 0: any) takes a sequence of `num_tokens`."""
        cap = self.register.max_prompt_tokens
        return not cap or num_tokens <= cap

    @property
    def free_blocks_estimate(self) -> int:
        """Allocatable blocks (free + evictable cached) as last reported, less what was placed since."""
        return self.pool.free_blocks + self.pool.cached_blocks - self.pending_blocks

    def peer(self) -> control_pb2.Peer:
        return control_pb2.Peer(
            role=self.role,
            endpoint=self.register.endpoint,
            incarnation=self.register.incarnation,
            kv_layout_hash=self.layout_hash,
        )

    def status(self, now: float) -> serving_pb2.WorkerStatus:
        reg = self.register
        return serving_pb2.WorkerStatus(
            role=self.role,
            worker_id=self.worker_id,
            control_address=reg.endpoint.control_address,
            transfer_address=reg.endpoint.transfer_address,
            model=reg.model,
            model_identity=reg.model_identity,
            health=self.health,
            last_heartbeat_age_ms=(now - self.last_seen) * 1e3,
            load=self.load,
            pool=self.pool,
        )

    def apply_report(self, pool: serving_pb2.KvPoolState, load: serving_pb2.WorkerLoad) -> None:
        """A fresh report covers everything placed before it (FIFO socket): pending work is now in it."""
        self.pool.CopyFrom(pool)
        self.load.CopyFrom(load)
        self.pending_blocks = self.pending_tokens = self.pending_long_tokens = 0

    def apply_prefix_events(self, events: control_pb2.PrefixCacheEvents, contiguous: bool) -> None:
        """Update the prefix view; a lost heartbeat (`contiguous` false) forgets the partial view first."""
        if events.cleared or not contiguous:
            self.prefix_hashes.clear()
        self.prefix_hashes.update(unpack_hashes(events.stored))
        self.prefix_hashes.difference_update(unpack_hashes(events.removed))


class WorkerRegistry:
    """Every registered worker by id. Owned by the coordinator app; event-loop only."""

    def __init__(self, model: ServedModel, heartbeat_timeout_s: float) -> None:
        self.model = model
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._workers: dict[str, WorkerInfo] = {}

    def __iter__(self) -> Iterator[WorkerInfo]:
        return iter(list(self._workers.values()))

    def get(self, worker_id: str) -> WorkerInfo | None:
        return self._workers.get(worker_id)

    def refusal(self, sender: str, reg: control_pb2.Register) -> str | None:
        """Why `reg` cannot join the pool (naming the field), or None when it can."""
        served = self.model
        if reg.protocol_version != control_pb2.PROTOCOL_VERSION_1:
            return f"protocol_version {reg.protocol_version} is not supported (the coordinator speaks 1)"
        if reg.role not in (PREFILL, DECODE, COLOCATED):
            return "role must be PREFILL, DECODE or COLOCATED"
        if reg.endpoint.worker_id != sender:
            return (
                f"endpoint.worker_id {reg.endpoint.worker_id!r} differs from the socket identity {sender!r}"
            )
        if reg.model != served.name:
            return f"model {reg.model!r} differs from the served model {served.name!r}"
        if reg.model_identity != served.identity:
            return (
                f"model_identity {reg.model_identity[:16]}... differs from the served model's "
                f"{served.identity[:16]}... (different weights, tokenizer or chat template)"
            )
        if reg.context_length < served.context_length:
            return f"context_length {reg.context_length} is below the served model's {served.context_length}"
        if reg.num_blocks == 0 or reg.kv_layout.block_size == 0:
            return "num_blocks and kv_layout.block_size must be positive"
        partners = [w for w in self if w.worker_id != sender and _pairs(w.role, reg.role)]
        if partners and all(w.layout_hash != reg.kv_layout.hash for w in partners):
            other = partners[0].register.kv_layout
            differing = [f for f in _LAYOUT_FIELDS if getattr(other, f) != getattr(reg.kv_layout, f)] or [
                "hash"
            ]
            return (
                f"kv_layout.{differing[0]} differs from the registered {partners[0].role_name} workers' "
                f"({getattr(reg.kv_layout, differing[0])!r} vs {getattr(other, differing[0])!r})"
            )
        return None

    def add(self, reg: control_pb2.Register, now: float) -> tuple[WorkerInfo, WorkerInfo | None]:
        """Register (or re-register) a worker; returns it and the incarnation it replaced, if any."""
        old = self._workers.get(reg.endpoint.worker_id)
        if old is not None and old.register.incarnation == reg.incarnation:
            old.last_seen = now
            return old, None  # a repeated Register of the same process
        info = WorkerInfo(register=reg, last_seen=now)
        self._workers[info.worker_id] = info
        return info, old

    def remove(self, worker_id: str) -> WorkerInfo | None:
        return self._workers.pop(worker_id, None)

    def heartbeat(self, sender: str, hb: control_pb2.Heartbeat, now: float) -> WorkerInfo | None:
        """Apply a heartbeat from a registered incarnation; None (ignored) otherwise."""
        info = self._workers.get(sender)
        if info is None or hb.incarnation != info.register.incarnation:
            return None
        info.last_seen = now
        info.health = DRAINING if hb.health == DRAINING else READY
        info.apply_prefix_events(hb.prefix_cache, contiguous=hb.seq == info.heartbeat_seq + 1)
        info.heartbeat_seq = hb.seq
        refused = load_refusal(hb.load)
        if refused is None:
            info.apply_report(hb.pool, hb.load)
        elif refused != info.load_refused:  # once per reason, not every heartbeat
            log.warning("worker load refused: routing keeps its last report", worker=sender, why=refused)
        info.load_refused = refused
        return info

    def sweep(self, now: float) -> list[WorkerInfo]:
        """Mark workers silent past the staleness bound STALE; returns those that just became stale."""
        newly = []
        for info in self:
            if info.health != STALE and now - info.last_seen > self.heartbeat_timeout_s:
                info.health = STALE
                newly.append(info)
        return newly

    def peers_for(self, info: WorkerInfo) -> list[control_pb2.Peer]:
        """Every registered worker of another role, as `info` needs to reach them."""
        return [w.peer() for w in self if w.role != info.role]

    def ready(self) -> list[WorkerInfo]:
        return [w for w in self if w.health == READY]

    def ready_counts(self) -> tuple[int, int]:
        """(prefill-capable, decode-capable) READY workers; a colocated worker counts in both."""
        ready = self.ready()
        return sum(w.does_prefill for w in ready), sum(w.does_decode for w in ready)

    def can_serve(self) -> bool:
        """A READY prefill + decode pair with equal KV layouts, or a READY colocated worker."""
        ready = self.ready()
        if any(w.role == COLOCATED for w in ready):
            return True
        decode_layouts = {w.layout_hash for w in ready if w.role == DECODE}
        return any(w.role == PREFILL and w.layout_hash in decode_layouts for w in ready)


def load_refusal(load: serving_pb2.WorkerLoad) -> str | None:
    """Why the router cannot price by `load` (naming the field), or None: every cost and time a
    finite number >= 0 (a NaN compares false both ways and would pick a path at random, an infinity
    or a negative cost would always win or lose), a share of a team at most 1, and the long prompts'
    tokens among the queued ones."""
    for fd in load.DESCRIPTOR.fields:
        value = getattr(load, fd.name)
        if fd.type == fd.TYPE_DOUBLE and not (math.isfinite(value) and value >= 0):
            return f"WorkerLoad.{fd.name} is {value!r}: give a finite number >= 0"
    if load.prompt_on_borrowed_cores_share > 1:
        return (
            f"WorkerLoad.prompt_on_borrowed_cores_share is {load.prompt_on_borrowed_cores_share!r}: at most 1"
        )
    if load.queued_long_tokens > load.queued_tokens:
        return (
            f"WorkerLoad.queued_long_tokens ({load.queued_long_tokens}) is over queued_tokens "
            f"({load.queued_tokens}): they are counted among them"
        )
    return None


def _pairs(role_a: serving_pb2.WorkerRole.ValueType, role_b: serving_pb2.WorkerRole.ValueType) -> bool:
    return {role_a, role_b} == {PREFILL, DECODE}
