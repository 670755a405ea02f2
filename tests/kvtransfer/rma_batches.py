"""A reader process for tests/kvtransfer/test_rma_wake.py: many concurrent `Rma.get` batches.

Run as `python -m tests.kvtransfer.rma_batches JSON` with JSON = {"layout", "peers": [{"address",
"key", "sources": [[rkey hex, address], ...]}, ...], "bad_peer", "nbytes", "batches", "runs"}:
connects a real UcxTransport to every agent, and batch `i` reads peer `i % len(peers)`'s source
`i // len(peers) % n` into local buffer `i` in `runs` gets of equal parts, all batches posted
before any is awaited. Batches on peer `bad_peer` also read one run from an address no mapping of
it covers, which fails that endpoint (UCP then fails every get on it) and no other. Prints one
JSON line: per batch "ok" or the error, CRC-32 per batch buffer, how many batches their poster
finished (`Rma.completed_inline`), and what the Rma still held after the transport closed.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import zlib
from typing import Any

import torch

from kvtransfer import KVLayout, create_transport
from kvtransfer.ucx import UcxPeer, UcxTransport
from kvtransfer.ucx_rma import GetRun

UNMAPPED = 1 << 46  # canonical user-space address far above any mapping of the agent


def _eventfds() -> int:
    """Open eventfds of this process."""
    fds = os.listdir("/proc/self/fd")
    return sum(1 for fd in fds if _link(f"/proc/self/fd/{fd}") == "anon_inode:[eventfd]")


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:  # the listing's own fd, closed since
        return ""


async def main(spec: dict[str, Any]) -> dict[str, Any]:
    transport = create_transport("ucx", KVLayout(**spec["layout"]))
    assert isinstance(transport, UcxTransport)
    await transport.start()
    peers = []
    for agent in spec["peers"]:
        peer = await transport.connect(agent["address"], bytes.fromhex(agent["key"]))
        assert isinstance(peer, UcxPeer)
        peers.append(peer)
    eventfds_before = _eventfds()
    rma, nbytes, runs = transport.rma, spec["nbytes"], spec["runs"]
    keys, sources = [], []
    for agent, peer in zip(spec["peers"], peers, strict=True):
        keys.append([peer.unpack_rkey(bytes.fromhex(rkey)) for rkey, _ in agent["sources"]])
        sources.append([int(address) for _, address in agent["sources"]])
    bufs = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(spec["batches"])]
    regions = [rma.register(buf) for buf in bufs]
    part = nbytes // runs
    futures = []
    for i, buf in enumerate(bufs):
        p = i % len(keys)
        j = i // len(keys) % len(sources[p])
        batch = [GetRun(buf.data_ptr() + k * part, sources[p][j] + k * part, part) for k in range(runs)]
        if p == spec["bad_peer"]:
            batch.insert(runs // 2, GetRun(buf.data_ptr(), UNMAPPED, part))
        futures.append(rma.get(keys[p][j], batch, regions[i]))
    in_flight = rma.pending
    outcomes = await asyncio.gather(*futures, return_exceptions=True)
    for key in (k for peer_keys in keys for k in peer_keys):
        key.close()
    for region in regions:
        region.close()
    await transport.close()
    return {
        "outcomes": ["ok" if o is None else f"{type(o).__name__}: {o}" for o in outcomes],
        "crcs": [zlib.crc32(buf.numpy().tobytes()) for buf in bufs],
        "in_flight_after_posting": in_flight,
        "completed_inline": rma.completed_inline,
        "pending_after_close": rma.pending,
        "eventfds_left": _eventfds() - eventfds_before,
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(json.loads(sys.argv[1])))))
