"""kvbench's `--model-shape` rows: a prompt's KV moved as the serving path moves it, per prompt length.

Both agents hold a block-major cache of the shape's layout and a `BlockPool` churned as a
long-running worker's (`agent.fragment_pool`, different seeds: a third of the pool held by other
requests in shuffled runs of 1-6 ids, the free list shuffled), so source and destination ids are
scattered and each side's runs end at different places. Each point is a warm-up prompt, verified
(CRC-32 of every block, checked by the receiver's session), then `repeats` timed ones. The timed part
is the transfer alone: the sender's blocks are filled and the receiver's reserved before the clock
starts, and no timed prompt is checksummed (a pass over its bytes on each side: at 32k tokens ~220 ms
against a ~90 ms transfer, which made the last of three timed repeats the slowest every time, so
the row's median was the slower of the other two; NIXL's row verifies off its clock).

- push backends (`ucx`, `tcp`, `nixl`...): a `RecvSession` posts every message of the plan, the
  sender's `SendSession` sends them all; the row's `messages` is the plan's message count.
- `ucx-get`, `nixl-get` (pull over UCX gets, NIXL READs: `PULL_BACKENDS`): the sender holds its
  filled blocks in a `PullSendSession` and exposes its pool once
  (`MappedPool` / `PoolSource`); the receiver reserves into a `PullRecvSession` and pulls the prompt
  chunk by chunk (`--chunk-tokens`, a prefill step's tokens), each chunk's gets all posted at once by
  `PullRecvSession.pull` (`plan.coalesce_runs`), as the decode worker does on each KVChunkReady;
  here every chunk is final at once, so chunks follow each other without waiting. `messages` is the
  number of gets per prompt. The clock runs in the driver over one request to the receiver
  (`pull_whole`: the chunks' reads, KVDone, the session's end), as nixl-raw's READ is clocked; push
  rows take three (the send, KVDone, the receiver's end).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtransfer.bench import get_loops, runner
from kvtransfer.bench.report import Progress, Row, format_size

PULL_BACKENDS = (get_loops.BACKEND, "nixl-get")  # their model rows pull; the others' push


@dataclass(frozen=True, slots=True)
class HugePageShare:
    """How much of each agent's KV cache is on huge pages (`kernels.host_memory.huge_page_share`;
    None where unknown). A row records it because a copy between processes walks 512 times as many
    pages on 4 KiB ones: a slow round on a host short of huge pages says so in its row."""

    send: float | None
    recv: float | None

    def as_row(self) -> dict[str, float | None]:
        return {"send": self.send, "recv": self.recv}


async def _acked(agents: runner.Agents, rid: str, t0: float, done: bool, messages: int) -> dict[str, Any]:
    """Stop the clock (the receiver's end was just answered), then KVAck releases the sender's
    blocks. `seconds` since `t0`, `done` (landed and verified)."""
    elapsed = time.perf_counter() - t0
    await agents.send.call("ack", rid=rid, gen=0)
    return {"seconds": elapsed, "done": done, "messages": messages}


async def _finish(
    agents: runner.Agents, rid: str, t0: float, checksums: list[int] | None, messages: int
) -> dict[str, Any]:
    """A push's KVDone (with the sender's checksums, if any) and the receiver's end, then `_acked`."""
    await agents.recv.call("mark_done", rid=rid, gen=0, first_token=1, checksums=checksums)
    result = await agents.recv.call("wait_recv", rid=rid, gen=0)
    return await _acked(agents, rid, t0, bool(result["done"]), messages)


async def _push_once(
    agents: runner.Agents, rid: str, n: int, seed: int, verify: bool, _: int
) -> dict[str, Any]:
    """One prompt through push sessions; `messages` is the plan's."""
    reserved = await agents.recv.call("reserve", rid=rid, gen=0, n_blocks=n, peer=agents.sender_address)
    send = {
        "rid": rid,
        "gen": 0,
        "peer": agents.receiver_address,
        "dst_ids": reserved["block_ids"],
        "secret": reserved["secret"],
    }
    await agents.send.call("send", **send, seed=seed, upto=0, checksums=False)  # fill; sends nothing
    t0 = time.perf_counter()
    sent = await agents.send.call("send", **send, checksums=verify)
    return await _finish(agents, rid, t0, sent["checksums"], reserved["messages"])


async def _pull_once(
    agents: runner.Agents, rid: str, n: int, seed: int, verify: bool, chunk_blocks: int
) -> dict[str, Any]:
    """One prompt pulled by the receiver with one-sided gets, chunk by chunk; `messages` is the gets."""
    exposed = await agents.send.call("pull_expose")  # the pool is mapped once; later calls reuse it
    source = await agents.send.call(
        "pull_source", rid=rid, gen=0, peer=agents.receiver_address, num_blocks=n, seed=seed,
        checksums=verify,
    )  # fmt: skip
    await agents.recv.call(
        "pull_reserve", rid=rid, gen=0, n_blocks=n, peer=agents.sender_address, source=exposed
    )
    t0 = time.perf_counter()
    pulled = await agents.recv.call(
        "pull_whole", rid=rid, gen=0, src_ids=source["src_ids"], chunk_blocks=chunk_blocks,
        checksums=source["checksums"],
    )  # fmt: skip
    return await _acked(agents, rid, t0, bool(pulled["done"]), pulled["gets"])


async def model_sweep(
    cfg: runner.BenchConfig, backend: str, memcpy_for: Callable[[int], float], progress: Progress
) -> list[Row]:
    """Move the KV of a prompt of each length in the shape's block layout (see module docstring)."""
    assert cfg.model_shape is not None
    layout = runner.model_layout(cfg.model_shape, cfg.block_size)
    max_blocks = max(-(-t // cfg.block_size) for t in cfg.tokens)
    move = _pull_once if backend in PULL_BACKENDS else _push_once
    chunk_blocks = max(1, cfg.chunk_tokens // cfg.block_size)
    agents = await runner.start_agents(cfg, backend, layout, max_blocks)
    rows = []
    try:
        backing = HugePageShare(
            (await agents.send.call("info"))["huge_page_share"],
            (await agents.recv.call("info"))["huge_page_share"],
        )
        for tokens in cfg.tokens:
            n = -(-tokens // cfg.block_size)
            times, verified, messages = [], True, 0
            for i in range(cfg.repeats + 1):  # the first is the warm-up, verified off the clock
                moved = await move(agents, f"bench-{tokens}-{i}", n, i, i == 0, chunk_blocks)
                verified &= moved["done"]
                messages = moved["messages"]
                if i:
                    times.append(moved["seconds"])
            row = model_row(
                cfg, backend, agents, tokens, n, layout.block_bytes, messages, times, verified, memcpy_for
            )
            row["huge_page_share"] = backing.as_row()
            rows.append(row)
            progress.step(f"{backend} {cfg.model_shape} {tokens} tokens")
    finally:
        await agents.close()
    return rows


def model_row(
    cfg: runner.BenchConfig,
    backend: str,
    agents: runner.Agents,
    tokens: int,
    n: int,
    block_bytes: int,
    messages: int,
    times: list[float],
    verified: bool,
    memcpy_for: Callable[[int], float],
) -> Row:
    size = n * block_bytes
    p50 = statistics.median(times)
    gbps = size / p50 / 1e9
    memcpy = memcpy_for(size)
    return {
        "mode": "model",
        "backend": backend,
        "model_shape": cfg.model_shape,
        "tokens": tokens,
        "blocks": n,
        "messages": messages,
        "chunk_tokens": cfg.chunk_tokens if backend in PULL_BACKENDS else None,
        "size_bytes": size,
        "size": format_size(size),
        "transfer_ms": p50 * 1e3,
        "gbps": gbps,
        "gbits": gbps * 8,
        "memcpy_gbps": memcpy,
        "ratio": gbps / memcpy,
        "p50_us": p50 * 1e6,
        "p99_us": max(times) * 1e6,
        "connect_ms": agents.connect_ms,
        "verified": verified,
        "transport": agents.transport,
        "repeats": cfg.repeats,
        **runner.row_inputs(cfg, backend),
    }


def add_raw_ratios(rows: list[Row]) -> None:
    """Give every model row `raw_gbps`/`raw_ratio`: its GB/s against the same backend's raw row of
    the largest size measured in its round of the run (`--raw-sizes`), where there is one."""
    raw: dict[tuple[str, int], Row] = {}
    for r in rows:
        key = (r["backend"], r.get("round", 0))
        if r["mode"] == "raw" and r["depth"] == 1 and r["size_bytes"] >= raw.get(key, r)["size_bytes"]:
            raw[key] = r
    for r in rows:
        if r["mode"] == "model" and (r["backend"], r.get("round", 0)) in raw:
            base = raw[(r["backend"], r.get("round", 0))]
            r["raw_size"], r["raw_gbps"] = base["size"], base["gbps"]
            r["raw_ratio"] = r["gbps"] / base["gbps"] if base["gbps"] else 0.0
