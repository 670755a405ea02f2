"""kvbench's `nixl-raw` row: raw NIXL (UCX backend) between two agent processes, measured as our raw rows are.

Measured as our raw rows are, side by side with them (`runner.raw_points`): two processes, rings
beyond the LLC on both sides (sender seeded, receiver zeroed), a warm-up run, `repeats` runs of
`duration`, the last verified by CRC-32 of every ring buffer on both sides, GB/s from the span
between the first and the last completion. Each variant (READ or WRITE, NIXL's progress thread off
or on) is a lane of its own and the row reports the best verified one (`best_variants`: `transport`
names it; `nixl_variants` holds all). Without the progress thread the target
progresses NIXL itself until the initiator's closing notification (as nixlbench's target does).

Its `--model-shape` rows move a prompt's KV as `model_sweep` moves ours: both agents hold a
block-major cache of the shape with a churned pool (`nixl_agent.op_pool`), the sender fills the
prompt's blocks, and the receiver READs them all in one NIXL request (one descriptor per run of ids
consecutive on both sides), the progress thread off; the last repeat is verified block by block.
Clocked as ours are, in the driver: from asking the receiver for the READ to its reply after the
completion (one control round trip, as our pull's `pull_whole` is); `in_agent_ms` keeps the READ
alone, timed inside the receiver agent (build to completion).
One request for the whole prompt is NIXL's best case: our `ucx-get` row pulls chunk by chunk
(`--chunk-tokens`), as the decode worker does while the prompt is prefilled.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from kvtransfer.bench import model_sweep
from kvtransfer.bench.control import AgentClient, spawn_agent
from kvtransfer.bench.report import PEER, Progress, Row
from kvtransfer.bench.runner import (
    Agents,
    BenchConfig,
    RawLane,
    RunReplies,
    agent_cpus,
    close_lanes,
    model_layout,
)
from kvtransfer.nixl_memory import import_nixl

VARIANTS = {
    "read": ("READ", False),
    "write": ("WRITE", False),
    "read+thread": ("READ", True),
    "write+thread": ("WRITE", True),
}


def nixl_missing() -> str | None:
    """Why the nixl row cannot run here, or None when NIXL is importable."""
    try:
        import_nixl()
    except ImportError as e:
        return str(e)
    return None


async def _start(cfg: BenchConfig, thread: bool) -> Agents:
    args = ["--progress-thread"] if thread else []
    cpus = agent_cpus() if cfg.pin_agents else [None, None]
    module = "kvtransfer.bench.nixl_agent"
    spawned = []
    for side, cpu in zip("ab", cpus, strict=True):
        extra, wrap = cfg.placement(side)
        spawned.append(spawn_agent([*args, *extra], cfg.agent_log, cpu=cpu, module=module, wrap=wrap))
    recv, send = AgentClient(spawned[0].control), AgentClient(spawned[1].control)
    agents = Agents(recv, send, spawned[0].address, spawned[1].address, 0.0, "nixl:UCX", spawned)
    try:
        recv_info, send_info = await recv.call("info"), await send.call("info")
        t0 = time.perf_counter()
        await send.call("connect", metadata=recv_info["metadata"])
        await recv.call("connect", metadata=send_info["metadata"])
        agents.connect_ms = (time.perf_counter() - t0) * 1e3
    except BaseException:
        await agents.close()
        raise
    return agents


async def _run(agents: Agents, op: str, thread: bool, iters: int, depth: int, used: int | None) -> RunReplies:
    """One run; `used`: verify that many ring buffers. Returns (receiver, sender) replies shaped
    as `runner.raw_row` reads them (span and latencies from the initiator)."""
    initiator, target = (agents.send, agents.recv) if op == "WRITE" else (agents.recv, agents.send)
    tag = uuid.uuid4().hex
    cpu0 = (await target.call("cpu"))["cpu_s"]
    calls = [initiator.call("xfer", operation=op, iters=iters, depth=depth, tag=tag, timeout=600)]
    if not thread:
        calls.append(target.call("progress", tag=tag, timeout=600))
    xfer = (await asyncio.gather(*calls))[0]
    target_cpu = (await target.call("cpu"))["cpu_s"] - cpu0
    checks: list[Any] = [None, None]
    if used is not None:
        checks = [(await a.call("checksums", used=used))["checksums"] for a in (agents.recv, agents.send)]
    recv = {"span_s": xfer["span_s"], "cpu_s": target_cpu, "checksums": checks[0]}
    return recv, {**xfer, "checksums": checks[1]}


async def _prepare_rings(ring_bytes: int | None, agents: Agents, size: int) -> int:
    sent = await agents.send.call("ring", size=size, seed=size, ring_bytes=ring_bytes)
    received = await agents.recv.call("ring", size=size, ring_bytes=ring_bytes)
    await agents.send.call("peer_ring", descs=received["descs"], metadata=received["metadata"])
    await agents.recv.call("peer_ring", descs=sent["descs"], metadata=sent["metadata"])
    return int(sent["ring"])


class _NixlPair:
    """A pair of NIXL agents (its progress thread off or on) and the ring size they hold, shared
    by the READ and WRITE lanes measured on it."""

    def __init__(self, agents: Agents, thread: bool, ring_bytes: int | None) -> None:
        self.agents, self.thread, self._ring_bytes = agents, thread, ring_bytes
        self._size: int | None = None
        self.buffers = 0

    async def ring(self, size: int) -> int:
        if self._size != size:
            self.buffers = await _prepare_rings(self._ring_bytes, self.agents, size)
            self._size = size
        return self.buffers


class NixlLane:
    """One NIXL variant's raw rows (`runner.RawLane`): READs or WRITEs on a `_NixlPair`."""

    backend: str = PEER

    def __init__(self, pair: _NixlPair, op: str) -> None:
        self.agents, self._pair, self._op = pair.agents, pair, op
        self.transport: str | None = f"nixl:UCX {op} thread {'on' if pair.thread else 'off'}"

    async def ring(self, size: int) -> int:
        return await self._pair.ring(size)

    async def run(self, iters: int, depth: int, verify: bool) -> RunReplies:
        used = min(iters, self._pair.buffers) if verify else None
        return await _run(self.agents, self._op, self._pair.thread, iters, depth, used)


async def open_lanes(cfg: BenchConfig) -> list[RawLane]:
    """A lane per variant of `cfg.nixl_variants`, on one agent pair per progress-thread setting.
    The caller closes the lanes' agents."""
    if cfg.peer is not None:
        raise SystemExit("--backend nixl-raw runs both of its agents on this host (drop --peer)")
    unknown = [v for v in cfg.nixl_variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown --nixl-variants {unknown}; choose from {sorted(VARIANTS)}")
    lanes: list[RawLane] = []
    try:
        for thread in (False, True):
            ops = [VARIANTS[v][0] for v in cfg.nixl_variants if VARIANTS[v][1] == thread]
            if ops:
                pair = _NixlPair(await _start(cfg, thread), thread, cfg.ring_bytes)
                lanes += [NixlLane(pair, op) for op in ops]
    except BaseException:
        await close_lanes(lanes)
        raise
    return lanes


def best_variants(rows: list[Row]) -> list[Row]:
    """`rows` with the nixl-raw rows of each (size, depth) replaced by the best verified one, in
    the first one's place; `nixl_variants` keeps every variant's GB/s, `verified` is all of theirs."""
    by_point: dict[tuple[int, int], list[Row]] = defaultdict(list)
    for r in rows:
        if r["backend"] == PEER:
            by_point[(r["size_bytes"], r["depth"])].append(r)
    merged = []
    for r in rows:
        if r["backend"] != PEER:
            merged.append(r)
        elif (candidates := by_point[(r["size_bytes"], r["depth"])])[0] is r:
            verified = [c for c in candidates if c["verified"]]
            best = dict(max(verified or candidates, key=lambda c: float(c["gbps"])))
            best["nixl_variants"] = {c["transport"]: c["gbps"] for c in candidates}
            best["verified"] = all(c["verified"] for c in candidates)
            merged.append(best)
    return merged


async def nixl_model_sweep(
    cfg: BenchConfig, memcpy_for: Callable[[int], float], progress: Progress
) -> list[Row]:
    """One model-shaped row per prompt length (module docstring), `model_sweep`'s row format."""
    assert cfg.model_shape is not None
    layout = model_layout(cfg.model_shape, cfg.block_size)
    max_blocks = max(-(-t // cfg.block_size) for t in cfg.tokens)
    agents = await _start(cfg, thread=False)
    rows = []
    try:
        sink = await agents.recv.call("pool", layout=layout.to_dict(), num_blocks=max_blocks, fragment=1)
        source = await agents.send.call("pool", layout=layout.to_dict(), num_blocks=max_blocks, fragment=2)
        backing = model_sweep.HugePageShare(source["huge_page_share"], sink["huge_page_share"])
        await agents.recv.call("peer_pool", metadata=source["metadata"])
        for tokens in cfg.tokens:
            n = -(-tokens // cfg.block_size)
            times, in_agent, verified, gets = [], [], True, 0
            for i in range(cfg.repeats + 1):  # the first is the warm-up
                src = (await agents.send.call("take", n=n, seed=i))["ids"]
                dst = (await agents.recv.call("take", n=n, seed=None))["ids"]
                tag = uuid.uuid4().hex
                read: dict[str, Any]
                t0 = time.perf_counter()
                read, _ = await asyncio.gather(
                    agents.recv.call(
                        "read_blocks",
                        ids=dst,
                        remote_ids=src,
                        remote_base=source["base"],
                        tag=tag,
                        timeout=600,
                    ),
                    agents.send.call("progress", tag=tag, timeout=600),
                )
                seconds = time.perf_counter() - t0
                if i == cfg.repeats:
                    verified = bool((await agents.recv.call("match", ids=dst, seed=i))["match"])
                await agents.recv.call("give", ids=dst)
                await agents.send.call("give", ids=src)
                gets = read["gets"]
                if i:
                    times.append(seconds)
                    in_agent.append(read["seconds"])
            row = model_sweep.model_row(
                cfg, "nixl-raw", agents, tokens, n, source["block_bytes"], gets, times, verified, memcpy_for
            )
            row["transport"] = "nixl:UCX READ thread off"
            row["huge_page_share"] = backing.as_row()
            row["in_agent_ms"] = statistics.median(in_agent) * 1e3
            rows.append(row)
            progress.step(f"nixl-raw {cfg.model_shape} {tokens} tokens")
    finally:
        await agents.close()
    return rows
