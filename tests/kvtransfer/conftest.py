"""Two real agent processes on 127.0.0.1 (ports from the OS), driven over the control channel."""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pytest

from kvtransfer import KVLayout
from kvtransfer.bench.control import AgentClient, SpawnedAgent, spawn_agent
from kvtransfer.bench.nixl_sweep import nixl_missing

LAYOUT = KVLayout(
    dtype="float16", num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, model_identity="tiny"
)
NUM_BLOCKS = 64
NIXL_MISSING = nixl_missing()
# Every backend the two-process tests cover; nixl only where it is installed (the `nixl` extra).
BACKENDS = [
    "ucx",
    "tcp",
    pytest.param("nixl", marks=pytest.mark.skipif(NIXL_MISSING is not None, reason=f"nixl: {NIXL_MISSING}")),
]


def agent_args(
    backend: str, layout: KVLayout = LAYOUT, fragment: int | None = 1, num_blocks: int = NUM_BLOCKS
) -> list[str]:
    args = ["--backend", backend, "--layout", json.dumps(layout.to_dict()), "--num-blocks", str(num_blocks)]
    return [*args, "--fragment", str(fragment)] if fragment is not None else args


@dataclass
class Pair:
    """A receiver (decode) and a sender (prefill) agent, connected sender -> receiver."""

    receiver: SpawnedAgent
    sender: SpawnedAgent
    recv: AgentClient
    send: AgentClient

    async def pools_free(self) -> None:
        for client in (self.recv, self.send):
            pool = await client.call("pool")
            # every block back, and every staging buffer given back or dropped
            assert pool["intact"] and pool["free"] == pool["total"] and pool["staging_lent"] == 0, pool


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _spawn_pair(backend: str) -> Iterator[tuple[SpawnedAgent, SpawnedAgent]]:
    receiver = spawn_agent(agent_args(backend, fragment=1))
    try:
        sender = spawn_agent(agent_args(backend, fragment=2))
    except Exception:
        receiver.stop()
        raise
    yield receiver, sender
    sender.stop()
    receiver.stop()


@pytest.fixture(scope="module")
def agents(backend: str) -> Iterator[tuple[SpawnedAgent, SpawnedAgent]]:
    """One pair of agent processes per module and backend (sessions use distinct request ids)."""
    yield from _spawn_pair(backend)


@pytest.fixture
def own_agents(backend: str) -> Iterator[tuple[SpawnedAgent, SpawnedAgent]]:
    """A pair for one test only, for tests that kill a process."""
    yield from _spawn_pair(backend)


async def connect_pair(receiver: SpawnedAgent, sender: SpawnedAgent) -> Pair:
    recv, send = AgentClient(receiver.control), AgentClient(sender.control)
    await send.call("connect", address=receiver.address, key=receiver.key)
    return Pair(receiver, sender, recv, send)


@pytest.fixture
async def pair(agents: tuple[SpawnedAgent, SpawnedAgent]) -> AsyncIterator[Pair]:
    p = await connect_pair(*agents)
    yield p
    p.recv.close()
    p.send.close()


async def send_into(pair: Pair, rid: str, reserved: Mapping[str, Any], **args: Any) -> dict[str, Any]:
    """The sender's `send` (generation 0) into the receiver's `reserve` result: its block ids and
    secret, as Reserved carries them."""
    dst = {"dst_ids": reserved["block_ids"], "secret": reserved["secret"]}
    return await pair.send.call("send", rid=rid, gen=0, peer=pair.receiver.address, **dst, **args)


async def assert_session_bit_exact(pair: Pair, rid: str, config: Mapping[str, float] | None = None) -> str:
    """One whole session of 24 fragmented blocks: the bytes land exactly, both pools end free.
    Returns the session's secret (hex), stale from then on."""
    reserved = await pair.recv.call(
        "reserve", rid=rid, gen=0, n_blocks=24, peer=pair.sender.address, config=config
    )
    ids = reserved["block_ids"]
    assert any(b != a + 1 for a, b in itertools.pairwise(ids)), "reservation should be fragmented"
    sent = await send_into(pair, rid, reserved, seed=7, config=config)
    assert sent["sent"], sent
    await pair.recv.call("mark_done", rid=rid, gen=0, first_token=42, checksums=sent["checksums"])
    result = await pair.recv.call("wait_recv", rid=rid, gen=0, seed=7)
    assert result == {"id": result["id"], "ok": True, "done": True, "first_token": 42, "exact": True}
    await pair.send.call("ack", rid=rid, gen=0)
    await pair.pools_free()
    return str(reserved["secret"])
