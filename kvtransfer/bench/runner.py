"""kvbench's orchestration: start (or reach) the two agents, sweep, and turn replies into rows.

Per point: a warm-up run (its first message, on fresh buffers, gives the registration cost), then
`repeats` runs sized to `duration` each; GB/s is the median over repeats, latency percentiles come
from the last run, and the last run is verified (CRC-32 of every ring buffer on both sides).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import IO, Any

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


async def _raw_run(
    agents: Agents, iters: int, depth: int, verify: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    import asyncio

    tag = _tag_base()
    recv, send = await asyncio.gather(
        agents.recv.call(
            "bench_recv", peer=agents.sender_address, iters=iters, tag_base=tag, verify=verify, timeout=600
        ),
        agents.send.call(
            "bench_send",
            peer=agents.receiver_address,
            iters=iters,
            tag_base=tag,
            depth=depth,
            verify=verify,
            timeout=600,
        ),
    )
    return recv, send


async def raw_sweep(
    cfg: BenchConfig, backend: str, memcpy: dict[int, float], progress: Progress
) -> list[Row]:
    agents = await start_agents(cfg, backend, RAW_LAYOUT, 1)
    rows = []
    try:
        for size in cfg.sizes:
            ring = (
                await agents.send.call(
                    "ring", size=size, seed=size, ring_bytes=cfg.ring_bytes, device=cfg.device
                )
            )["ring"]
            await agents.recv.call("ring", size=size, ring_bytes=cfg.ring_bytes, device=cfg.device)
            for depth in cfg.depths:
                warm_iters = max(2 * depth, ring)  # touches (and registers) every ring buffer once
                t0 = time.perf_counter()
                _, warm = await _raw_run(agents, warm_iters, depth, verify=False)
                per_iter = (time.perf_counter() - t0) / warm_iters
                iters = max(ring, 2 * depth, math.ceil(cfg.duration_s / per_iter))
                runs = [
                    await _raw_run(agents, iters, depth, verify=i == cfg.repeats - 1)
                    for i in range(cfg.repeats)
                ]
                rows.append(raw_row(cfg, backend, size, depth, iters, memcpy[size], agents, warm, runs))
                progress.step(f"{backend} {format_size(size)} depth {depth}")
    finally:
        await agents.close()
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
    runs: list[tuple[dict[str, Any], dict[str, Any]]],
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
