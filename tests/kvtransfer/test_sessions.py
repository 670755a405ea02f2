"""Two real processes, both backends: pairing, and sessions whose every path leaves both pools
fully free."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping

import pytest

from kvtransfer.bench.control import AgentClient, AgentError, SpawnedAgent, spawn_agent
from tests.kvtransfer.conftest import (
    LAYOUT,
    Pair,
    agent_args,
    assert_session_bit_exact,
    connect_pair,
    send_into,
)

# Small messages so a session has many (direct and packed) messages to abort between.
SMALL = {"max_message_bytes": 4 << 10, "min_direct_bytes": 2 << 10}


@pytest.mark.parametrize("config", [SMALL, None], ids=["small-eager", "whole-rendezvous"])
async def test_bit_exact_into_non_contiguous_blocks(pair: Pair, config: Mapping[str, float] | None) -> None:
    # SMALL: many messages below UCX's rendezvous threshold; default: one packed 12 KiB message,
    # which UCX moves by rendezvous (on one host, the receiver's CMA read).
    await assert_session_bit_exact(pair, f"r1-{config is None}", config)


async def test_packed_messages_reuse_their_staging_buffers(pair: Pair) -> None:
    # the default config packs the 24 fragmented blocks into one message on both sides (blocks far
    # below min_direct_bytes): after one session, a second allocates no staging buffer on either
    await assert_session_bit_exact(pair, "staging-a")
    before = [await c.call("pool") for c in (pair.recv, pair.send)]
    await assert_session_bit_exact(pair, "staging-b")
    after = [await c.call("pool") for c in (pair.recv, pair.send)]
    assert all(b["staging_allocated"] > 0 for b in before), before
    assert [a["staging_allocated"] for a in after] == [b["staging_allocated"] for b in before]


async def _start_half(pair: Pair, rid: str, config: Mapping[str, float]) -> list[int]:
    """Reserve 24 blocks on the receiver and send the first half of them."""
    reserved = await pair.recv.call(
        "reserve", rid=rid, gen=0, n_blocks=24, peer=pair.sender.address, config=config
    )
    sent = await send_into(pair, rid, reserved, upto=12, config=config)
    assert sent["sent"], sent
    return list(reserved["block_ids"])


@pytest.mark.parametrize("first", ["receiver", "sender"])
async def test_abort_mid_transfer_frees_both_pools(pair: Pair, first: str) -> None:
    await _start_half(pair, f"r2-{first}", SMALL)
    order = [pair.recv, pair.send] if first == "receiver" else [pair.send, pair.recv]
    for client in order:
        assert (await client.call("abort", rid=f"r2-{first}", gen=0))["state"] == "aborted"
    await pair.pools_free()


async def test_lease_timeout_frees_both_pools(pair: Pair) -> None:
    config = {**SMALL, "lease_s": 0.5}
    await _start_half(pair, "r3", config)
    recv, send = await asyncio.gather(
        pair.recv.call("wait_recv", rid="r3", gen=0), pair.send.call("wait_send", rid="r3", gen=0)
    )
    assert recv["reason"] == send["reason"] == "lease expired"
    await pair.pools_free()


async def test_sender_killed_frees_receiver_pool(own_agents: tuple[SpawnedAgent, SpawnedAgent]) -> None:
    pair = await connect_pair(*own_agents)
    await _start_half(pair, "r4", {**SMALL, "lease_s": 120})
    pair.sender.process.kill()
    result = await pair.recv.call("wait_recv", rid="r4", gen=0)
    assert not result["done"] and result["reason"].startswith("peer lost"), result
    pool = await pair.recv.call("pool")
    assert pool["intact"] and pool["free"] == pool["total"] and pool["staging_lent"] == 0, pool
    pair.recv.close()
    pair.send.close()


async def test_unposted_receiver_is_never_written(pair: Pair) -> None:
    reserved = await pair.recv.call(
        "reserve", rid="r5", gen=0, n_blocks=8, peer=pair.sender.address, post=False
    )
    ids = reserved["block_ids"]
    # UCX may complete small (eager) sends locally; either way nobody acknowledges, the lease ends it.
    await send_into(pair, "r5", reserved, config={"lease_s": 0.5})
    assert (await pair.send.call("wait_send", rid="r5", gen=0))["reason"] == "lease expired"
    assert (await pair.recv.call("untouched", block_ids=ids))["untouched"]
    await pair.recv.call("free", block_ids=ids)
    await pair.pools_free()


async def test_layout_mismatch_is_refused(agents: tuple[SpawnedAgent, SpawnedAgent], backend: str) -> None:
    receiver, _ = agents
    other = spawn_agent(agent_args(backend, dataclasses.replace(LAYOUT, head_dim=16), fragment=None))
    client = AgentClient(other.control)
    try:
        with pytest.raises(AgentError, match="head_dim"):
            await client.call("connect", address=receiver.address, key=receiver.key)
    finally:
        client.close()
        other.stop()
