"""kvbench's NIXL peer: one NIXL agent (UCX backend) in a process of its own, driven as our agents are.

    python -m kvtransfer.bench.nixl_agent [--progress-thread] [--control-port P]

It prints `KVAGENT-READY {"control": ..., "name": ...}` and answers the JSON requests of
`control.AgentClient` one at a time until `shutdown`. For the raw rows it holds one ring of buffers
(`bench_loops.new_ring`, registered with NIXL), so the NIXL row rotates through the same bytes beyond
the LLC as ours. The initiator of a run (the sender for WRITE, the receiver for READ) posts one-sided
transfers, ring buffer i to ring buffer i; the target only progresses (without NIXL's progress thread)
until the initiator's closing notification. For the model-shaped rows it holds a block-major KV cache
of the shape and a pool churned as our agents' (`agent.fragment_pool`), registered once; the receiver
READs a prompt's scattered blocks in one NIXL request, one descriptor per run of consecutive ids on
both sides (`plan.coalesce_runs`, the runs our `ucx-get` pulls). This is a benchmark peer for trusted hosts: the control channel is not
authenticated and NIXL's metadata is taken as given.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from collections import deque
from typing import Any

import structlog
import torch
import zmq

from engine.block_pool import BlockPool
from kernels import host_memory
from kvtransfer.bench.agent import fragment_pool
from kvtransfer.bench.bench_loops import cpu_seconds, new_ring, percentiles_us, ring_checksums
from kvtransfer.bench.control import READY_PREFIX, bind_router, die_with_parent, parse_request
from kvtransfer.bench.pattern import block_bytes, blocks_match, fill_blocks
from kvtransfer.layout import KVLayout
from kvtransfer.nixl_memory import import_nixl
from kvtransfer.plan import coalesce_runs

log = structlog.get_logger(__name__)
INIT_AGENT = "NIXL_INIT_AGENT"


class NixlBenchAgent:
    """Owns a NIXL agent, its registered ring and the transfer handles towards one peer."""

    def __init__(self, progress_thread: bool) -> None:
        nixl = import_nixl()
        self.name = f"kvbench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        config = nixl.nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
        self.nixl = nixl.nixl_agent(self.name, config)
        self.progress_thread = progress_thread
        self.ring: list[torch.Tensor] = []
        self.registered: Any = None
        self.peer: str | None = None
        self.handles: dict[str, list[Any]] = {}
        self.dlists: list[Any] = []
        self.pool: BlockPool | None = None  # the model-shaped rows' cache and pool (op_pool)
        self.cache = torch.empty(0, dtype=torch.uint8)
        self.stopped = False

    # -- set-up -----------------------------------------------------------------------------------

    def op_info(self) -> dict[str, Any]:
        return {"name": self.name, "metadata": self.nixl.get_agent_metadata().hex()}

    def op_connect(self, metadata: str) -> dict[str, Any]:
        """Load the peer's metadata (connection info); returns immediately, wires up lazily."""
        t0 = time.perf_counter()
        self.peer = self.nixl.add_remote_agent(bytes.fromhex(metadata))
        if isinstance(self.peer, bytes):
            self.peer = self.peer.decode()
        return {"connect_s": time.perf_counter() - t0, "peer": self.peer}

    def _release(self) -> None:
        for handles in self.handles.values():
            for handle in handles:
                handle.release()
        for dlist in self.dlists:
            dlist.release()
        self.handles, self.dlists = {}, []
        if self.registered is not None:
            self.nixl.deregister_memory(self.registered)
            self.registered = None
        self.pool = None

    def op_ring(self, size: int, seed: int | None = None, ring_bytes: int | None = None) -> dict[str, Any]:
        """A fresh registered ring; returns its descriptors and the metadata of its registration."""
        self._release()
        self.ring = []
        self.ring = new_ring(size, seed, "cpu", ring_bytes)
        self.registered = self.nixl.register_memory(self.ring)
        descs = self.nixl.get_serialized_descs(self.nixl.get_xfer_descs(self.ring))
        metadata = self.nixl.get_partial_agent_metadata(self.registered, False)
        return {"ring": len(self.ring), "descs": descs.hex(), "metadata": metadata.hex()}

    def op_peer_ring(self, descs: str, metadata: str) -> dict[str, Any]:
        """Prepare READ and WRITE handles, local buffer i <-> the peer's buffer i."""
        assert self.peer is not None, "connect first"
        self.nixl.add_remote_agent(bytes.fromhex(metadata))  # the peer's new registration
        remote = self.nixl.deserialize_descs(bytes.fromhex(descs))
        local_list = self.nixl.prep_xfer_dlist(INIT_AGENT, self.nixl.get_xfer_descs(self.ring))
        remote_list = self.nixl.prep_xfer_dlist(self.peer, remote)
        self.dlists = [local_list, remote_list]
        self.handles = {
            op: [
                self.nixl.make_prepped_xfer(op, local_list, [i], remote_list, [i])
                for i in range(len(self.ring))
            ]
            for op in ("READ", "WRITE")
        }
        return {}

    def op_pool(self, layout: dict[str, Any], num_blocks: int, fragment: int) -> dict[str, Any]:
        """A registered block-major cache of `layout` whose pool has `num_blocks` free in scattered
        runs (half as many again held, as `agent.serve --fragment` does); returns its base address,
        block size and the registration's metadata for the peer."""
        self._release()
        kv = KVLayout.from_dict(layout)
        extra = num_blocks // 2
        self.pool = BlockPool(num_blocks + extra, kv.block_size)
        fragment_pool(self.pool, fragment, extra)
        self.cache = block_bytes(kv.new_cache(self.pool.num_blocks, "cpu"))
        share = host_memory.report_backing(self.cache, "kv cache")
        self.registered = self.nixl.register_memory([self.cache])
        metadata = self.nixl.get_partial_agent_metadata(self.registered, False)
        return {
            "base": self.cache.data_ptr(),
            "block_bytes": self.cache.shape[1],
            "metadata": metadata.hex(),
            "huge_page_share": share,
        }

    def op_peer_pool(self, metadata: str) -> dict[str, Any]:
        self.nixl.add_remote_agent(bytes.fromhex(metadata))
        return {}

    def op_take(self, n: int, seed: int | None) -> dict[str, Any]:
        """`n` blocks from the pool: filled with the pattern of `seed` (the sender), or zeroed."""
        assert self.pool is not None, "pool first"
        ids = self.pool.allocate(n)
        if ids is None:
            raise RuntimeError(f"the pool has {self.pool.num_free_blocks} free blocks, {n} asked")
        if seed is None:
            self.cache[ids] = 0
        else:
            fill_blocks(self.cache, ids, seed)
        return {"ids": ids}

    def op_give(self, ids: list[int]) -> dict[str, Any]:
        assert self.pool is not None, "pool first"
        self.pool.free(ids)
        return {}

    def op_match(self, ids: list[int], seed: int) -> dict[str, Any]:
        return {"match": blocks_match(self.cache, ids, seed)}

    def op_read_blocks(
        self, ids: list[int], remote_ids: list[int], remote_base: int, tag: str
    ) -> dict[str, Any]:
        """Initiator: READ the peer's blocks `remote_ids` into `ids` (logical block i to i) as one
        NIXL request, one descriptor per run; then notify `tag`. `seconds`: building the request
        to its completion, as a decode worker would pay per prompt."""
        assert self.peer is not None, "connect first"
        size, base = self.cache.shape[1], self.cache.data_ptr()
        t0 = time.perf_counter()
        runs = coalesce_runs(remote_ids, ids)
        local = self.nixl.get_xfer_descs([(base + r.dst * size, r.n * size, 0) for r in runs], "DRAM")
        remote = self.nixl.get_xfer_descs([(remote_base + r.src * size, r.n * size, 0) for r in runs], "DRAM")
        handle = self.nixl.initialize_xfer("READ", local, remote, self.peer)
        state = self.nixl.transfer(handle)
        while state == "PROC":
            state = self.nixl.check_xfer_state(handle)
        seconds = time.perf_counter() - t0
        self.nixl.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"NIXL READ of {len(runs)} runs ended {state}")
        self.nixl.send_notif(self.peer, tag.encode())
        return {"seconds": seconds, "gets": len(runs)}

    def op_checksums(self, used: int) -> dict[str, Any]:
        return {"checksums": ring_checksums(self.ring, used)}

    def op_shutdown(self) -> dict[str, Any]:
        self.stopped = True
        return {}

    # -- runs -------------------------------------------------------------------------------------

    def op_progress(self, tag: str) -> dict[str, Any]:
        """Target side: progress NIXL until the initiator's notification `tag` arrives."""
        want = tag.encode()
        while not any(want in msgs for msgs in self.nixl.get_new_notifs().values()):
            pass
        return {}

    def op_cpu(self) -> dict[str, Any]:
        """CPU seconds of this process so far (its progress thread included)."""
        return {"cpu_s": cpu_seconds()}

    def op_xfer(self, operation: str, iters: int, depth: int, tag: str) -> dict[str, Any]:
        """Initiator side: `iters` transfers `operation` (READ or WRITE) with `depth` in flight (at most one per buffer),
        then notify the target with `tag`. Latency: post to completion seen here."""
        assert self.peer is not None, "connect first"
        op = operation
        handles = self.handles[op]
        depth = min(depth, len(handles))
        inflight: deque[tuple[Any, float, str]] = deque()
        latencies: list[float] = []
        done_at: list[float] = []
        cpu0, t_start, posted = cpu_seconds(), time.perf_counter(), 0
        while posted < iters or inflight:
            while posted < iters and len(inflight) < depth:
                handle = handles[posted % len(handles)]
                t0 = time.perf_counter()
                inflight.append((handle, t0, self.nixl.transfer(handle)))
                posted += 1
            handle, t0, state = inflight[0]
            if state == "PROC":
                state = self.nixl.check_xfer_state(handle)
            if state == "ERR":
                raise RuntimeError(f"NIXL {op} failed")
            if state == "DONE":
                inflight.popleft()
                now = time.perf_counter()
                latencies.append(now - t0)
                done_at.append(now)
        elapsed = time.perf_counter() - t_start
        self.nixl.send_notif(self.peer, tag.encode())
        return {
            "elapsed_s": elapsed,
            "span_s": done_at[-1] - done_at[0] if len(done_at) > 1 else 0.0,
            "cpu_s": cpu_seconds() - cpu0,
            "first_us": latencies[0] * 1e6,
            **percentiles_us(latencies),
        }

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op, request_id = request.pop("op"), request.pop("id")
        handler = getattr(self, f"op_{op}", None)
        try:
            if handler is None:
                raise ValueError(f"unknown op {op!r}")
            return {"id": request_id, "ok": True, **handler(**request)}
        except Exception as e:
            log.warning("nixl agent request failed", op=op, error=repr(e))
            return {"id": request_id, "ok": False, "error": repr(e)}


def serve(args: argparse.Namespace) -> None:
    agent = NixlBenchAgent(args.progress_thread)
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    control = bind_router(router, args.host, args.control_port, args.control_endpoint)
    info = {"control": control, "address": agent.name, "key": "", "backend": "nixl"}
    print(READY_PREFIX + json.dumps(info), flush=True)
    try:
        while not agent.stopped:
            parsed = parse_request(router.recv_multipart())
            if parsed is None:
                log.warning("malformed control request dropped")
                continue
            identity, request = parsed
            router.send_multipart([identity, json.dumps(agent.handle(request)).encode()])
    finally:
        agent._release()
        router.close()
        context.term()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="kvtransfer.bench.nixl_agent", description=__doc__)
    p.add_argument("--progress-thread", action="store_true", help="NIXL's progress thread on")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--control-port", type=int, default=0)
    p.add_argument("--control-endpoint", default=None, help="bind control here instead (ipc://PATH)")
    p.add_argument("--die-with-parent", action="store_true", help="exit when the spawning process dies")
    args = p.parse_args(argv)
    if args.die_with_parent:
        die_with_parent()
    torch.set_num_threads(1)
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    serve(args)


if __name__ == "__main__":
    main()
