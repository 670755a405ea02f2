"""Two real agent processes over UCX: D pulls P's KV with one-sided gets (kvtransfer.pull).

Both pools are fragmented (different seeds), so source and destination ids are non-contiguous and
the runs differ on each side. Every scenario ends with both pools fully free and intact.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from pathlib import Path
from typing import Any

import pytest

from engine.worker.settings import WorkerSettings
from kvtransfer.bench import cli
from kvtransfer.bench.control import AgentError, SpawnedAgent
from kvtransfer.plan import Run, coalesce_runs
from tests.kvtransfer.conftest import BACKENDS, Pair, connect_pair

N = 24
PULL_BACKENDS = [b for b in BACKENDS if getattr(b, "values", [b])[0] != "tcp"]


def test_coalesce_runs_cuts_where_either_side_breaks() -> None:
    src = [10, 11, 12, 3, 4, 20, 21]
    dst = [5, 6, 7, 8, 9, 40, 50]
    assert coalesce_runs(src, dst, start=2) == [
        Run(2, 10, 5, 3),
        Run(5, 3, 8, 2),
        Run(7, 20, 40, 1),
        Run(8, 21, 50, 1),
    ]
    with pytest.raises(ValueError, match="source ids"):
        coalesce_runs([1], [1, 2])


@pytest.fixture(scope="module", params=PULL_BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """Pull needs one-sided reads: the conftest's `pair` and `own_agents` run on UCX (gets) and
    NIXL (READs) here."""
    return str(request.param)


async def open_pull(
    pair: Pair, rid: str, config: dict[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """P's pull source and D's reservation for one session of N blocks: (source, reserved)."""
    source = await pair.send.call(
        "pull_source", rid=rid, gen=0, peer=pair.receiver.address, num_blocks=N, seed=5, config=config
    )
    exposed = await pair.send.call("pull_expose")
    reserved = await pair.recv.call(
        "pull_reserve", rid=rid, gen=0, n_blocks=N, peer=pair.sender.address, source=exposed, config=config
    )
    return source, reserved


async def test_pull_in_chunks_is_bit_exact_into_fragmented_blocks(pair: Pair) -> None:
    source, reserved = await open_pull(pair, "exact")
    src, dst = source["src_ids"], reserved["block_ids"]
    assert any(b != a + 1 for a, b in itertools.pairwise(dst)), "reservation should be fragmented"
    assert src != dst
    first = await pull_pull(pair, "exact", 0, src[:10])
    second = await pull_pull(pair, "exact", 10, src[10:])
    assert 1 <= first["gets"] < 10 and 1 <= second["gets"] < N - 10  # runs were coalesced
    await pair.recv.call("mark_done", rid="exact", gen=0, first_token=9, checksums=source["checksums"])
    result = await pair.recv.call("wait_recv", rid="exact", gen=0, seed=5)
    assert result["done"] and result["exact"] and result["first_token"] == 9, result
    await pair.send.call("ack", rid="exact", gen=0)
    await pair.pools_free()


async def pull_pull(pair: Pair, rid: str, start: int, src_ids: list[int]) -> dict[str, Any]:
    return await pair.recv.call("pull", rid=rid, gen=0, start=start, src_ids=src_ids)


async def test_a_finished_sessions_key_reads_nothing(pair: Pair) -> None:
    source, _ = await open_pull(pair, "stale")
    await pull_pull(pair, "stale", 0, source["src_ids"])
    await pair.recv.call("mark_done", rid="stale", gen=0, first_token=1, checksums=source["checksums"])
    assert (await pair.recv.call("wait_recv", rid="stale", gen=0, seed=5))["exact"]
    await pair.send.call("ack", rid="stale", gen=0)
    # P has released its sources; D's ended session refuses to read again, its key is destroyed.
    with pytest.raises(AgentError, match="SessionAborted"):
        await pull_pull(pair, "stale", 0, source["src_ids"])
    await pair.pools_free()


async def test_out_of_pool_and_out_of_order_chunks_are_refused(pair: Pair) -> None:
    source, _ = await open_pull(pair, "bounds")
    with pytest.raises(AgentError, match="outside the peer's pool"):
        await pull_pull(pair, "bounds", 0, [10_000])
    with pytest.raises(AgentError, match="chunk"):
        await pull_pull(pair, "bounds", 3, source["src_ids"][3:6])
    for client in (pair.recv, pair.send):
        assert (await client.call("abort", rid="bounds", gen=0))["state"] == "aborted"
    await pair.pools_free()


async def test_checksum_mismatch_aborts_and_frees(pair: Pair) -> None:
    source, _ = await open_pull(pair, "crc")
    await pull_pull(pair, "crc", 0, source["src_ids"])
    bad = [c ^ 1 for c in source["checksums"]]
    await pair.recv.call("mark_done", rid="crc", gen=0, first_token=1, checksums=bad)
    result = await pair.recv.call("wait_recv", rid="crc", gen=0)
    assert result == {**result, "done": False, "reason": "checksum mismatch"}
    await pair.send.call("abort", rid="crc", gen=0)
    await pair.pools_free()


async def test_abort_mid_transfer_and_lease_expiry_free_both_pools(
    own_agents: tuple[SpawnedAgent, SpawnedAgent],
) -> None:
    # A fresh pair: D's first reads wire its endpoint up, which needs P's progress, and P aborts
    # while they may be in flight. D's abort waits for them (NIXL's READs hung when P stopped
    # progressing its agent as its last session ended: three runs in four).
    pair = await connect_pair(*own_agents)
    source, _ = await open_pull(pair, "abort")
    await pull_pull(pair, "abort", 0, source["src_ids"][:8])
    assert (await pair.send.call("abort", rid="abort", gen=0))["state"] == "aborted"
    assert (await pair.recv.call("abort", rid="abort", gen=0, timeout=30))["state"] == "aborted"
    # Lease: neither side hears from the other after the first chunk.
    lease = {"lease_s": 0.5}
    source, _ = await open_pull(pair, "lease", config=lease)
    await pull_pull(pair, "lease", 0, source["src_ids"][:8])
    assert (await pair.recv.call("wait_recv", rid="lease", gen=0))["reason"] == "lease expired"
    assert (await pair.send.call("wait_send", rid="lease", gen=0))["reason"] == "lease expired"
    await pair.pools_free()
    pair.recv.close()
    pair.send.close()


@pytest.mark.parametrize("victim", ["sender", "receiver"])
async def test_kill_either_side_mid_session_frees_the_survivor(
    backend: str, own_agents: tuple[SpawnedAgent, SpawnedAgent], victim: str
) -> None:
    pair = await connect_pair(*own_agents)
    source, _ = await open_pull(pair, "kill")
    await pull_pull(pair, "kill", 0, source["src_ids"][:8])
    dead, alive = (pair.sender, pair.recv) if victim == "sender" else (pair.receiver, pair.send)
    dead.process.kill()
    wait_op = "wait_recv" if victim == "sender" else "wait_send"
    result = await alive.call(wait_op, rid="kill", gen=0)
    # on NIXL a READ failing against the dead P may end D's session before its socket reports it;
    # UCX fails the endpoint first
    reasons = ("peer lost", "get failed") if backend == "nixl" else ("peer lost",)
    assert not result["done"] and result["reason"].startswith(reasons), result
    pool = await alive.call("pool")
    assert pool["intact"] and pool["free"] == pool["total"], pool
    pair.recv.close()
    pair.send.close()


def test_kvbench_ucx_get_row_is_measured_and_verified(tmp_path: Path) -> None:
    out = tmp_path / "rows.jsonl"
    argv = ["run", "--backend", "ucx-get", "--sizes", "256KiB", "--depth", "1,4", "--duration", "0.05"]
    argv += [
        "--repeats",
        "1",
        "--ring-bytes",
        "4MiB",
        "--json",
        str(out),
        "--agent-log",
        str(tmp_path / "a.log"),
    ]
    assert cli.main(argv) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["backend"], r["depth"]) for r in rows] == [("ucx-get", 1), ("ucx-get", 4)]
    for r in rows:
        assert r["verified"] is True and r["gbps"] > 0 and r["iters"] >= 16  # the whole ring, rotated
        assert r["ratio"] == pytest.approx(r["gbps"] / r["memcpy_gbps"])


def test_pull_mode_needs_a_backend_with_one_sided_reads() -> None:
    base = {
        "role": "decode",
        "model": "tiny",
        "coordinator": "h:1",
        "worker_id": "d",
        "insecure_control_plane": True,
    }
    assert WorkerSettings(**base, kv_transfer_mode="pull").kv_transfer_mode == "pull"
    with pytest.raises(ValueError, match="needs --transfer-backend ucx or nixl"):
        WorkerSettings(**base, kv_transfer_mode="pull", transfer_backend="tcp")
    with pytest.raises(ValueError, match="auto"):
        WorkerSettings(**base, kv_transfer_mode="pul")
    # auto, the default: pull over UCX (gets) and NIXL (READs), push over TCP
    assert WorkerSettings(**base).pulls and WorkerSettings(**base, kv_transfer_mode="push").pulls is False
    assert not WorkerSettings(**base, transfer_backend="tcp").pulls
    assert WorkerSettings(**base, transfer_backend="nixl").pulls
    assert not WorkerSettings(**base, transfer_backend="nixl", kv_transfer_mode="push").pulls


@pytest.mark.parametrize("victim", ["sender", "receiver"])
async def test_kill_either_side_mid_get_stream(
    backend: str, own_agents: tuple[SpawnedAgent, SpawnedAgent], victim: str
) -> None:
    """kill -9 while 64 MiB gets are in flight (on one host: D's CMA reads of P's memory): a dead P
    fails D's gets (D keeps serving); a dead D leaves P untouched (P took no part). The raw get
    loops are UCX's (kvbench's ucx-get row)."""
    if backend != "ucx":
        pytest.skip("the raw get loops run on UCX")
    pair = await connect_pair(*own_agents)
    size = 64 << 20
    await pair.send.call("ring", size=size, seed=1, ring_bytes=4 * size)
    await pair.recv.call("ring", size=size, ring_bytes=4 * size)
    sources = (await pair.send.call("get_expose"))["sources"]
    stream = asyncio.ensure_future(
        pair.recv.call(
            "bench_get", peer=pair.sender.address, sources=sources, iters=1 << 20, depth=2, timeout=60
        )
    )
    deadline = time.monotonic() + 60
    while (await pair.recv.call("gets_done"))["gets"] < 3:  # a bounded readiness probe
        assert time.monotonic() < deadline, "the get stream did not start"
        await asyncio.sleep(0.01)
    if victim == "sender":
        pair.sender.process.kill()
        with pytest.raises(AgentError, match=r"RmaError|PeerLost"):
            await stream
        assert pair.receiver.process.poll() is None, "D died with P"
        await pair.recv.call("pool")  # still serving
    else:
        pair.receiver.process.kill()
        stream.cancel()
        await asyncio.gather(stream, return_exceptions=True)
        assert (await pair.send.call("pool"))["intact"]
    pair.recv.close()
    pair.send.close()
