"""kvbench's orchestration: start (or reach) the two agents, sweep, and turn replies into rows.

Per point: a warm-up run (its first message, on fresh buffers, gives the registration cost), then
`repeats` runs sized to `duration` each, taken in turn with the other backends' (`raw_points`); GB/s
is the median over repeats, latency percentiles come from the last run, and the last run is verified
(CRC-32 of every ring buffer on both sides).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, Any, Protocol

from kvtransfer import KVLayout
from kvtransfer.bench.bench_loops import default_ring_bytes
from kvtransfer.bench.control import AgentClient, AgentError, SpawnedAgent, spawn_agent
from kvtransfer.bench.netns import NetnsPair
from kvtransfer.bench.report import Progress, Row, format_size

# Variants of `--backend`: the agent arguments each one means.
BACKEND_ARGS = {
    "ucx": ["--backend", "ucx"],
    "ucx-stock": ["--backend", "ucx", "--stock"],
    "ucx-get": ["--backend", "ucx"],  # one-sided gets by the receiver (bench/get_loops.py)
    "tcp": ["--backend", "tcp"],
    "nixl": ["--backend", "nixl"],
    "nixl-tensor": ["--backend", "nixl", "--nixl-register", "tensor"],
    "nixl-thread": ["--backend", "nixl", "--nixl-progress-thread"],
    "nixl-get": ["--backend", "nixl"],  # --model-shape: pull sessions, D's NIXL READs (nixl_rma)
}
# Peers measured beside ours, each by its own agent (`kvtransfer.bench.nixl_agent`), local only:
# raw NIXL, as nixlbench drives it (our `nixl` backend is a row of ours).
PEER_BACKENDS = ("nixl-raw",)
RAW_LAYOUT = KVLayout("uint8", 1, 1, 1, 1, "kvbench-raw")
GIB = 1 << 30


@dataclass
class BenchConfig:
    backends: list[str]
    sizes: list[int]
    depths: list[int] = field(default_factory=lambda: [1])
    duration_s: float = 2.0
    repeats: int = 3
    rounds: int = 1  # the backend list this many times, reversed every other round
    progress_mode: str | None = None
    ucx_opts: list[str] = field(default_factory=list)
    peer: str | None = None  # control endpoint of a remote `kvbench serve` (receiver side)
    model_shape: str | None = None
    tokens: list[int] = field(default_factory=list)
    block_size: int = 16
    chunk_tokens: int = 512  # ucx-get model rows: tokens per pulled chunk (a prefill step's budget)
    raw_sizes: list[int] = field(default_factory=list)  # model mode: raw rows measured in the same run
    command: str = ""
    agent_log: IO[str] | None = None
    pin_agents: bool = False
    ring_bytes: int | None = None  # bytes each side rotates through (None: 4x the LLC)
    busy: int = 0  # busy-loop processes running beside the agents (`--busy`)
    nixl_variants: list[str] = field(default_factory=lambda: ["read", "write", "read+thread", "write+thread"])
    device: str = "cpu"  # where both agents keep their rings and caches (cuda: cuda_ipc on one host)
    netns: NetnsPair | None = None  # `--netns`: receiver in its namespace "a", sender in "b"

    @property
    def link(self) -> str:
        """The link between the agents, as rows record it."""
        if self.netns is not None:
            return self.netns.link
        return "remote peer" if self.peer else "loopback"

    def placement(self, side: str) -> tuple[list[str], list[str]]:
        """(extra agent arguments, command prefix) of the agent on `side` ("a" receiver, "b" sender)."""
        if self.netns is None:
            return [], []
        return self.netns.agent_args(side), self.netns.wrap(side)

    def agent_args(self, backend: str) -> list[str]:
        args = list(BACKEND_ARGS.get(backend, []))
        if self.progress_mode and backend.startswith("ucx"):
            args += ["--progress-mode", self.progress_mode]
        for opt in self.ucx_opts if backend.startswith("ucx") else []:
            args += ["--ucx-opt", opt]
        return args


@dataclass
class Agents:
    recv: AgentClient
    send: AgentClient
    receiver_address: str
    sender_address: str
    connect_ms: float
    transport: str
    spawned: list[SpawnedAgent]

    async def close(self) -> None:
        """Shut the agents we spawned down cleanly (a remote `serve` keeps running)."""
        for agent, client in zip(self.spawned[::-1], (self.send, self.recv), strict=False):
            with contextlib.suppress(AgentError, TimeoutError):
                await client.call("shutdown", timeout=10)
            agent.stop(grace_s=10)
        self.recv.close()
        self.send.close()


async def start_agents(cfg: BenchConfig, backend: str, layout: KVLayout, num_blocks: int) -> Agents:
    """Spawn the sender (and, without `--peer`, the receiver) and connect sender -> receiver."""
    args = [
        *cfg.agent_args(backend),
        "--layout",
        json.dumps(layout.to_dict()),
        "--num-blocks",
        str(num_blocks),
        "--device",
        cfg.device,
    ]
    spawned = []
    cpus = agent_cpus() if cfg.pin_agents else [None, None]
    if cfg.peer is None:
        extra, wrap = cfg.placement("a")
        spawned.append(spawn_agent([*args, *extra, "--fragment", "1"], cfg.agent_log, cpu=cpus[0], wrap=wrap))
        recv = AgentClient(spawned[0].control)
    else:
        recv = AgentClient(cfg.peer)
    extra, wrap = cfg.placement("b")
    spawned.append(spawn_agent([*args, *extra, "--fragment", "2"], cfg.agent_log, cpu=cpus[1], wrap=wrap))
    send = AgentClient(spawned[-1].control)
    receiver = await recv.call("info")
    receiver_address = receiver["address"]
    connected = await send.call("connect", address=receiver_address, key=receiver["key"])
    sender_address = (await send.call("info"))["address"]
    return Agents(
        recv,
        send,
        receiver_address,
        sender_address,
        connected["connect_s"] * 1e3,
        connected["transports"],
        spawned,
    )


def agent_cpus() -> list[int | None]:
    """Two distinct cores of ours for the receiver and the sender (no pinning with fewer than two)."""
    cpus = sorted(os.sched_getaffinity(0))
    return [cpus[0], cpus[1]] if len(cpus) >= 2 else [None, None]


def _tag_base() -> int:
    return random.getrandbits(31) << 32


RunReplies = tuple[dict[str, Any], dict[str, Any]]  # one run's (receiver side, sender side) replies


class RawLane(Protocol):
    """One backend's raw measurement on agents it started: rings per size, runs on demand.

    `raw_points` drives several lanes side by side; the lane's owner closes `agents`."""

    backend: str
    agents: Agents
    transport: str | None  # the row's `transport` where it is not `agents.transport` (a variant)

    async def ring(self, size: int) -> int:
        """Give both sides a ring of `size`-byte buffers; how many buffers a ring holds."""
        ...

    async def run(self, iters: int, depth: int, verify: bool) -> RunReplies:
        """`iters` messages of the current size, `depth` in flight; `verify`: checksum both rings."""
        ...


class TwoSidedLane:
    """Our push backends' raw rows (`ucx`, `tcp`, `nixl`...): the sender's tagged sends, the
    receiver's posted receives (`bench_loops`)."""

    transport: str | None = None

    def __init__(self, backend: str, agents: Agents, device: str, ring_bytes: int | None) -> None:
        self.backend, self.agents = backend, agents
        self._device, self._ring_bytes = device, ring_bytes

    @classmethod
    async def open(cls, cfg: BenchConfig, backend: str) -> TwoSidedLane:
        return cls(backend, await start_agents(cfg, backend, RAW_LAYOUT, 1), cfg.device, cfg.ring_bytes)

    async def ring(self, size: int) -> int:
        send, recv = self.agents.send, self.agents.recv
        sent = await send.call("ring", size=size, seed=size, ring_bytes=self._ring_bytes, device=self._device)
        await recv.call("ring", size=size, ring_bytes=self._ring_bytes, device=self._device)
        return int(sent["ring"])

    async def run(self, iters: int, depth: int, verify: bool) -> RunReplies:
        agents, tag = self.agents, _tag_base()
        recv, send = await asyncio.gather(
            agents.recv.call(
                "bench_recv", peer=agents.sender_address, iters=iters, tag_base=tag, verify=verify, timeout=600
            ),
            agents.send.call(
                "bench_send", peer=agents.receiver_address, iters=iters, tag_base=tag, depth=depth,
                verify=verify, timeout=600,
            ),
        )  # fmt: skip
        return recv, send


async def close_lanes(lanes: Sequence[RawLane]) -> None:
    """Close every agent pair the lanes run on, once each (lanes may share a pair)."""
    for agents in {id(lane.agents): lane.agents for lane in lanes}.values():
        await agents.close()


async def raw_points(
    cfg: BenchConfig, lanes: Sequence[RawLane], memcpy: dict[int, float], progress: Progress
) -> list[Row]:
    """Every lane's row at every (size, depth), the lanes measured side by side.

    Per point each lane prepares its ring and takes a warm-up run (which sizes its runs to
    `cfg.duration_s`), then the lanes take their `repeats` runs in turn, the order reversed every
    other repeat (A B, B A, A B): a ratio between two lanes compares runs at most a run apart, so a
    slow spell of the host (seconds long on a shared VM) lands on both. The last repeat is verified.
    Rows come lane by lane per point; each records when its runs started (`repeat_started_at`,
    Unix seconds, to lay against other records of the host)."""
    rows: list[Row] = []
    for size in cfg.sizes:
        rings = [await lane.ring(size) for lane in lanes]
        for depth in cfg.depths:
            planned = []  # (warm-up replies, iterations per run) per lane
            for lane, ring in zip(lanes, rings, strict=True):
                warm_iters = max(2 * depth, ring)  # touches (and registers) every ring buffer once
                t0 = time.perf_counter()
                _, warm = await lane.run(warm_iters, depth, verify=False)
                per_iter = (time.perf_counter() - t0) / warm_iters
                planned.append((warm, max(ring, 2 * depth, math.ceil(cfg.duration_s / per_iter))))
            runs: list[list[RunReplies]] = [[] for _ in lanes]
            starts: list[list[float]] = [[] for _ in lanes]
            for i in range(cfg.repeats):
                for k in range(len(lanes)) if i % 2 == 0 else reversed(range(len(lanes))):
                    starts[k].append(time.time())
                    runs[k].append(await lanes[k].run(planned[k][1], depth, verify=i == cfg.repeats - 1))
            for lane, (warm, iters), lane_runs, lane_starts in zip(lanes, planned, runs, starts, strict=True):
                row = raw_row(
                    cfg, lane.backend, size, depth, iters, memcpy[size], lane.agents, warm, lane_runs
                )
                row["repeat_started_at"] = lane_starts
                if lane.transport is not None:
                    row["transport"] = lane.transport
                rows.append(row)
            for backend in dict.fromkeys(lane.backend for lane in lanes):
                progress.step(f"{backend} {format_size(size)} depth {depth}")
    return rows


def raw_row(
    cfg: BenchConfig,
    backend: str,
    size: int,
    depth: int,
    iters: int,
    memcpy: float,
    agents: Agents,
    warm: dict[str, Any],
    runs: list[RunReplies],
) -> Row:
    rates = [(iters - 1) * size / recv["span_s"] / 1e9 for recv, _ in runs if recv["span_s"] > 0]
    gbps = statistics.median(rates) if rates else 0.0
    last_recv, last_send = runs[-1]
    cpu = sum(recv["cpu_s"] + send["cpu_s"] for recv, send in runs) / (len(runs) * iters * size / GIB)
    return {
        "mode": "raw",
        "backend": backend,
        "size_bytes": size,
        "size": format_size(size),
        "depth": depth,
        "iters": iters,
        "repeats": cfg.repeats,
        "gbps": gbps,
        "gbits": gbps * 8,
        "gbps_repeats": rates,
        "memcpy_gbps": memcpy,
        "ratio": gbps / memcpy,
        "p50_us": last_send["p50_us"],
        "p99_us": last_send["p99_us"],
        "p999_us": last_send["p999_us"],
        "cpu_s_per_gib": cpu,
        "connect_ms": agents.connect_ms,
        "reg_ms": max(0.0, warm["first_us"] - warm["p50_us"]) / 1e3,
        "verified": last_recv["checksums"] == last_send["checksums"],
        "transport": agents.transport,
        **row_inputs(cfg, backend),
    }


def row_inputs(cfg: BenchConfig, backend: str) -> Row:
    return {
        "duration_s": cfg.duration_s,
        "settings": {
            "agent_args": cfg.agent_args(backend),
            "env_ucx": {k: v for k, v in os.environ.items() if k.startswith("UCX")},
            "pin_agents": cfg.pin_agents,
            "ring_bytes": cfg.ring_bytes or default_ring_bytes(),
            "device": cfg.device,
        },
        "command": cfg.command,
        "host": os.uname().nodename,
        "load1": os.getloadavg()[0],  # other work on a shared machine skews absolute numbers
        "busy": cfg.busy,
        "link": cfg.link,
    }


def model_layout(shape: str, block_size: int) -> KVLayout:
    """The block-major layout of a named shape from engine.shapes (imported only in this mode)."""
    try:
        from engine.shapes import SHAPES
    except ImportError as e:
        raise SystemExit(
            f"--model-shape needs engine/shapes.py (SHAPES), which is not importable: {e}"
        ) from e
    if shape not in SHAPES:
        raise SystemExit(f"unknown model shape {shape!r}; known: {', '.join(SHAPES)}")
    c = SHAPES[shape]
    return KVLayout(
        str(c.torch_dtype), c.num_hidden_layers, block_size, c.num_key_value_heads, c.head_dim, shape
    )
