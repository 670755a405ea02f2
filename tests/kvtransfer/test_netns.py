"""Two agents as two pods on two nodes: separate network namespaces joined by a veth pair, separate
IPC/PID/UTS/mount namespaces. Sessions move bit-exact over network lanes only (no shared memory, no
CMA), and no namespace outlives its run, even when the run is killed."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from kvtransfer.bench import model_sweep, netns, nixl_sweep, raw_sweep, runner
from kvtransfer.bench.control import spawn_agent
from kvtransfer.bench.report import Progress
from tests.kvtransfer.conftest import Pair, agent_args, assert_session_bit_exact, connect_pair

MISSING = netns.netns_missing()
pytestmark = [
    pytest.mark.skipif(MISSING is not None, reason=f"no namespaces here: {MISSING}"),
    pytest.mark.xdist_group("netns"),
]
SAME_HOST_LANES = ("sysv", "posix", "cma", "xpmem", "knem")
WAIT_S = 30.0


def namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    files = {p.name for p in netns.NETNS_DIR.glob("*")} if netns.NETNS_DIR.is_dir() else set()
    return {line.split()[0] for line in listed.splitlines() if line.strip()} | files


@pytest.fixture(scope="module")
def link() -> Iterator[netns.NetnsPair]:
    with netns.NetnsPair(mtu=1500) as pair:
        yield pair
    assert not set(pair.names.values()) & namespaces(), "a namespace outlived its pair"
    assert not pair.control_dir.exists()


@pytest.fixture(params=["ucx", "tcp"])
async def cross(request: pytest.FixtureRequest, link: netns.NetnsPair) -> AsyncIterator[Pair]:
    backend = str(request.param)
    receiver = spawn_agent([*agent_args(backend, fragment=1), *link.agent_args("a")], wrap=link.wrap("a"))
    try:
        sender = spawn_agent([*agent_args(backend, fragment=2), *link.agent_args("b")], wrap=link.wrap("b"))
    except Exception:
        receiver.stop()
        raise
    pair = await connect_pair(receiver, sender)
    yield pair
    for client, agent in ((pair.send, sender), (pair.recv, receiver)):
        await client.call("shutdown")
        client.close()
        agent.stop(grace_s=10)


async def test_session_moves_bit_exact_over_network_lanes_only(cross: Pair) -> None:
    assert cross.receiver.address.startswith(netns.ADDRESSES["a"] + ":")
    connected = await cross.send.call("connect", address=cross.receiver.address, key=cross.receiver.key)
    lanes = connected["transports"]
    assert not any(name in lanes for name in SAME_HOST_LANES), lanes
    assert lanes == "tcp" or "tcp/veth0(" in lanes, lanes
    await assert_session_bit_exact(cross, "x1")
    await assert_session_bit_exact(cross, "x2", {"max_message_bytes": 4 << 10, "min_direct_bytes": 2 << 10})


@pytest.mark.skipif(nixl_sweep.nixl_missing() is not None, reason="NIXL is not installed")
async def test_nixl_row_moves_verified_bytes_across_the_link(link: netns.NetnsPair) -> None:
    size = 256 << 10
    cfg = runner.BenchConfig(
        backends=["nixl-raw"],
        sizes=[size],
        duration_s=0.02,
        repeats=1,
        ring_bytes=1 << 20,
        nixl_variants=["write"],
        netns=link,
    )
    (row,) = await raw_sweep.raw_sweep(cfg, cfg.backends, {size: 1.0}, Progress(1))
    assert row["verified"] and row["gbps"] > 0 and row["link"] == "veth mtu 1500"


@pytest.mark.skipif(nixl_sweep.nixl_missing() is not None, reason="NIXL is not installed")
async def test_our_nixl_pull_reads_verified_blocks_across_the_link(link: netns.NetnsPair) -> None:
    """The NIXL backend's pull (its `auto`, across hosts too): D's READs of P's churned pool over
    UCX's TCP lanes, chunk by chunk, every block verified."""
    cfg = runner.BenchConfig(
        backends=["nixl-get"], sizes=[], model_shape="llama-2l", tokens=[256], chunk_tokens=64, repeats=1,
        netns=link,
    )  # fmt: skip
    (row,) = await model_sweep.model_sweep(cfg, "nixl-get", lambda _: 1.0, Progress(1))
    assert row["verified"] and row["link"] == "veth mtu 1500" and row["messages"] > 1, row


def test_a_killed_run_leaves_nothing_the_next_run_does_not_reap(tmp_path: Path) -> None:
    # a run that built its namespaces and started an agent in one, then got SIGKILL (no teardown)
    script = textwrap.dedent(
        f"""
        import sys
        from kvtransfer.bench import netns
        from kvtransfer.bench.control import spawn_agent
        from tests.kvtransfer.conftest import agent_args
        pair = netns.NetnsPair().__enter__()
        spawn_agent([*agent_args("tcp"), *pair.agent_args("a")], open({str(tmp_path / "a.log")!r}, "w"),
                    wrap=pair.wrap("a"))
        print("NAMES", *pair.names.values(), flush=True)
        sys.stdin.read()
        """
    )
    run = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert run.stdout is not None
        names = next(line.split()[1:] for line in run.stdout if line.startswith("NAMES "))
        assert len(names) == 2 and set(names) <= namespaces()
    finally:
        run.kill()
        run.wait()
    deadline = time.monotonic() + WAIT_S
    while subprocess.run(["ip", "netns", "pids", names[0]], capture_output=True, text=True).stdout.strip():
        assert time.monotonic() < deadline, "the agent outlived the run that spawned it"
        time.sleep(0.05)  # poll interval of a bounded wait
    netns.reap_stale()  # what the next run does first (a concurrent run may have reaped them already)
    assert not set(names) & namespaces()


def test_bad_mtu_is_refused_before_anything_is_built() -> None:
    with pytest.raises(ValueError, match="MTU"):
        netns.NetnsPair(mtu=100)
