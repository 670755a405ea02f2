"""Two real processes, both backends: one dies in the middle of a stream of large messages (on one
host UCX moves them by the receiver's CMA reads from the sender's memory). The survivor's transfer
fails with PeerLost, and the survivor keeps serving: it pairs with a new peer and moves bytes exactly."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvtransfer import KVLayout
from kvtransfer.bench.control import AgentError, SpawnedAgent, spawn_agent
from tests.kvtransfer.conftest import Pair, agent_args, assert_session_bit_exact, connect_pair, send_into

MESSAGE_BYTES = 64 << 20  # ~10 ms per message here: a kill lands inside one
RING_BYTES = 4 * MESSAGE_BYTES  # a kill test, not a speed test: no need to rotate beyond the LLC
ENDLESS = 1 << 20  # messages: the stream outlives the test
WAIT_S = 60.0


async def kill_mid_stream(pair: Pair, victim: str, tag_base: int) -> SpawnedAgent:
    """Stream endless large messages from `pair.sender` to `pair.receiver`, SIGKILL `victim` ("sender"
    or "receiver") once three more landed; the survivor's call fails with PeerLost and the survivor
    lives. Returns the survivor (its clients on `pair` are closed)."""
    await asyncio.gather(
        pair.recv.call("ring", size=MESSAGE_BYTES, ring_bytes=RING_BYTES),
        pair.send.call("ring", size=MESSAGE_BYTES, seed=1, ring_bytes=RING_BYTES),
    )
    landed = (await pair.recv.call("landed"))["landed"]  # over the agent's life
    common = {"iters": ENDLESS, "tag_base": tag_base, "timeout": WAIT_S}
    receiving = asyncio.ensure_future(pair.recv.call("bench_recv", peer=pair.sender.address, **common))
    sending = asyncio.ensure_future(
        pair.send.call("bench_send", peer=pair.receiver.address, depth=2, **common)
    )
    deadline = time.monotonic() + WAIT_S
    while (await pair.recv.call("landed"))["landed"] < landed + 3:
        assert time.monotonic() < deadline, f"fewer than 3 messages landed in {WAIT_S} s"
        await asyncio.sleep(0.01)  # poll interval of a bounded wait

    sender_dies = victim == "sender"
    dead, alive = (pair.sender, pair.receiver) if sender_dies else (pair.receiver, pair.sender)
    dead.process.kill()
    with pytest.raises(AgentError, match="PeerLost"):
        await (receiving if sender_dies else sending)
    (sending if sender_dies else receiving).cancel()  # the dead agent's call never answers
    await asyncio.gather(receiving, sending, return_exceptions=True)
    assert alive.process.poll() is None, "the survivor died with its peer"
    pair.recv.close()
    pair.send.close()
    return alive


async def test_peer_killed_mid_stream_leaves_the_survivor_serving(
    own_agents: tuple[SpawnedAgent, SpawnedAgent], backend: str
) -> None:
    """The sender dies mid-stream: the receiver pairs with a fresh sender and moves a session
    exactly. Then that receiver dies mid-stream: the new sender pairs with a fresh receiver and moves
    a session exactly. (Both deaths in one chain: four agent processes instead of six.)"""
    fresh: list[SpawnedAgent] = []
    try:
        receiver = await kill_mid_stream(await connect_pair(*own_agents), "sender", 1 << 40)
        fresh.append(spawn_agent(agent_args(backend, fragment=3)))
        pair = await connect_pair(receiver, fresh[-1])
        await assert_session_bit_exact(pair, "after-sender-death")
        sender = await kill_mid_stream(pair, "receiver", 2 << 40)
        fresh.append(spawn_agent(agent_args(backend, fragment=3)))
        new_pair = await connect_pair(fresh[-1], sender)
        await assert_session_bit_exact(new_pair, "after-receiver-death")
        new_pair.recv.close()
        new_pair.send.close()
    finally:
        for agent in fresh:
            agent.stop()


# 256 KiB blocks; a session of 480 blocks (120 MiB) in 16 MiB direct messages (pools unfragmented).
BIG_LAYOUT = KVLayout(
    dtype="float16", num_layers=4, block_size=16, num_kv_heads=8, head_dim=128, model_identity="big"
)
BIG_SESSION = {"lease_s": 120, "max_message_bytes": 16 << 20}


async def test_sender_killed_mid_message_frees_receiver_pool(backend: str) -> None:
    """The kill lands while a message's bytes stream in (not between messages, as in
    test_sessions): the receive in progress must end too, so the session can release its blocks."""
    receiver = spawn_agent(agent_args(backend, BIG_LAYOUT, fragment=None, num_blocks=512))
    sender = spawn_agent(agent_args(backend, BIG_LAYOUT, fragment=None, num_blocks=512))
    try:
        pair = await connect_pair(receiver, sender)
        reserved = await pair.recv.call(
            "reserve", rid="k", gen=0, n_blocks=480, peer=sender.address, config=BIG_SESSION
        )
        sending = asyncio.ensure_future(send_into(pair, "k", reserved, config=BIG_SESSION))
        deadline = time.monotonic() + WAIT_S
        while (await pair.recv.call("recv_progress", rid="k", gen=0))["landed"] < 2:
            assert time.monotonic() < deadline and not sending.done(), "the session did not start streaming"
            await asyncio.sleep(0.001)  # poll interval of a bounded wait
        sender.process.kill()
        result = await pair.recv.call("wait_recv", rid="k", gen=0, timeout=WAIT_S)
        assert not result["done"] and result["reason"].startswith("peer lost"), result
        pool = await pair.recv.call("pool")
        assert pool["intact"] and pool["free"] == pool["total"] and pool["staging_lent"] == 0, pool
        sending.cancel()
        await asyncio.gather(sending, return_exceptions=True)
        pair.recv.close()
        pair.send.close()
    finally:
        sender.stop()
        receiver.stop()
