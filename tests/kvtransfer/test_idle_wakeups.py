"""An idle UCX process leaves its core alone: the progress thread sleeps `UcxSettings.idle_wait_ms`
(100 ms) between wake-ups with nothing to do, not UCXX's 1 ms (docs/kvtransfer.md, session 40).
Real agent processes with a started UCX transport and a connected peer, counted from /proc."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvtransfer.bench.control import spawn_agent
from kvtransfer.ucx import UcxSettings

from .conftest import agent_args, assert_session_bit_exact, connect_pair

WINDOW_S = 1.0  # the measurement window (a rate is counted over it; nothing waits on it)


def _voluntary_switches(pid: int) -> int:
    """Voluntary context switches of every thread of `pid`: each is a wake-up after a sleep."""
    total = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        try:
            text = status.read_text()
        except OSError:  # a thread that ended while we listed them
            continue
        total += int(text.split("voluntary_ctxt_switches:")[1].split()[0])
    return total


def _wakeups_per_s(pids: list[int]) -> list[float]:
    before = [_voluntary_switches(p) for p in pids]
    time.sleep(WINDOW_S)
    return [(_voluntary_switches(p) - b) / WINDOW_S for p, b in zip(pids, before, strict=True)]


def test_settings_refuse_a_wait_below_a_millisecond_and_stock_keeps_ucxxs() -> None:
    with pytest.raises(ValueError, match="idle_wait_ms must be >= 1"):
        UcxSettings(idle_wait_ms=0)
    assert UcxSettings().progress_thread_wait_ms == 100
    assert UcxSettings(tuned=False).progress_thread_wait_ms == 1


async def test_an_idle_agents_progress_thread_wakes_at_its_idle_wait_not_every_millisecond() -> None:
    """Connected, then idle for the window: ours wakes ~10 times a second, one at UCXX's 1 ms ~1,000.
    After the idle a session still moves bit-exact (events wake the thread, not its timeout)."""
    ours = spawn_agent(agent_args("ucx", fragment=1))
    ucxx = spawn_agent([*agent_args("ucx", fragment=2), "--ucx-idle-wait-ms", "1"])
    pair = await connect_pair(receiver=ours, sender=ucxx)
    try:
        slept, woken = _wakeups_per_s([ours.process.pid, ucxx.process.pid])
        assert slept < 100, f"an idle agent woke {slept:.0f} times a second"
        assert woken > 3 * slept + 100, (slept, woken)  # UCXX's 1 ms: ~1,000 a second
        await assert_session_bit_exact(pair, "after-idle")
    finally:
        pair.recv.close()
        pair.send.close()
        ucxx.stop()
        ours.stop()
