"""Pairing between real processes: a layout mismatch is refused, naming the field."""

from __future__ import annotations

import dataclasses

import pytest

from kvtransfer.bench.control import AgentClient, AgentError, SpawnedAgent, spawn_agent
from tests.kvtransfer.conftest import LAYOUT, agent_args


async def test_layout_mismatch_is_refused(agents: tuple[SpawnedAgent, SpawnedAgent], backend: str) -> None:
    receiver, _ = agents
    other = spawn_agent(agent_args(backend, dataclasses.replace(LAYOUT, head_dim=16), fragment=None))
    client = AgentClient(other.control)
    try:
        with pytest.raises(AgentError, match="head_dim"):
            await client.call("connect", address=receiver.address)
    finally:
        client.close()
        other.stop()
