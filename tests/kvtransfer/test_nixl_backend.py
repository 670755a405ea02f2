"""The NIXL backend's own contract, in-process over real loopback sockets and real NIXL agents: the
hello refuses a wrong key before any NIXL metadata moves, cancel and match semantics, exactly-once
completion, and what each registration mode keeps registered. (The two-process session, abort,
lease, kill -9 and outsider tests run it through the `backend` parametrization of conftest.py.)"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import torch

from kvtransfer import NixlSettings, NixlTransport, Peer, TransportError
from kvtransfer.bench import cli
from tests.kvtransfer.conftest import LAYOUT, NIXL_MISSING

pytestmark = pytest.mark.skipif(NIXL_MISSING is not None, reason=f"nixl: {NIXL_MISSING}")
WAIT_S = 30.0


async def _until(condition: object, what: str) -> None:
    """Bounded wait for a condition only another task can make true."""
    deadline = time.monotonic() + WAIT_S
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"not within {WAIT_S} s: {what}"
        await asyncio.sleep(0.001)  # poll interval of a bounded wait


class Pair:
    def __init__(self, settings: NixlSettings) -> None:
        self.recv_side, self.send_side = NixlTransport(LAYOUT, settings), NixlTransport(LAYOUT, settings)
        self.to_sender: Peer
        self.to_receiver: Peer

    async def start(self) -> None:
        await self.recv_side.start()
        await self.send_side.start()
        self.to_sender = await self.recv_side.connect(self.send_side.address, self.send_side.key)
        await _until(lambda: self.send_side.peer(self.recv_side.address) is not None, "accepted")
        peer = self.send_side.peer(self.recv_side.address)
        assert peer is not None
        self.to_receiver = peer

    async def close(self) -> None:
        await self.recv_side.close()
        await self.send_side.close()


@pytest.fixture(params=["storage", "tensor", "thread"])
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[Pair]:
    """The two registration modes with NIXL's progress thread off (the default: the sender's loop
    progresses its agent while a send waits for the READ; without that the READ's endpoint never
    finished wiring up), and the storage mode with the thread on."""
    if request.param == "thread":
        p = Pair(NixlSettings(progress_thread=True))
    else:
        p = Pair(NixlSettings(register=request.param))
    await p.start()
    yield p
    await p.close()


async def test_an_idle_connected_pair_leaves_the_cores_alone() -> None:
    """With the default settings nothing progresses NIXL while no transfer is in flight: NIXL's own
    progress thread (no delay between rounds) spun a core per agent, idle or not. The window is a
    measurement, not a synchronization: CPU time of this process over one second of wall time."""
    p = Pair(NixlSettings())
    await p.start()
    try:
        src = torch.ones(1 << 20, dtype=torch.uint8)
        dst = torch.zeros_like(src)
        posted = p.to_sender.post_recv(1, dst)  # one transfer first: every endpoint wired up
        await asyncio.wait_for(p.to_receiver.send(1, src), WAIT_S)
        assert await posted.wait()
        cpu0, wall0 = time.process_time(), time.monotonic()
        await asyncio.sleep(1.0)
        cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
        assert cpu < 0.25 * wall, f"two idle NIXL agents used {cpu:.2f} CPU s in {wall:.2f} s"
    finally:
        await p.close()


async def test_a_pull_source_progresses_its_agent_until_its_reader_can_read_no_more() -> None:
    """P's loop progresses its agent while a pull session is served; an acknowledged one stops it at
    once (every READ of D's landed), an aborted one only after its lease: D may still have READs in
    flight it posted before it heard, and they complete only with P's progress."""
    transport = NixlTransport(LAYOUT, NixlSettings())
    await transport.start()
    try:
        rma = transport.rma
        rma.serve(+1)
        assert rma.progressing
        rma.serve(-1)  # acknowledged
        assert not rma.progressing
        rma.serve(+1)
        rma.serve(-1, linger_s=0.2)  # aborted, with a 0.2 s lease
        assert rma.progressing
        lingered = time.monotonic()
        await _until(lambda: not rma.progressing, "the linger ends")
        assert time.monotonic() - lingered >= 0.15
    finally:
        await transport.close()


async def test_wrong_key_is_refused_before_any_nixl_metadata_moves() -> None:
    listener, other = NixlTransport(LAYOUT), NixlTransport(LAYOUT)
    await listener.start()
    await other.start()
    try:
        with pytest.raises(TransportError, match="does not hold the transfer key"):
            await other.connect(listener.address, secrets.token_bytes(32))
        await _until(lambda: listener.refused["closed"] + listener.refused["auth"] >= 1, "refusal counted")
        assert listener.peer(other.address) is None
        # Neither agent learned the other's NIXL connection metadata.
        assert not other.agent.check_remote_metadata(listener.name)
        assert not listener.agent.check_remote_metadata(other.name)
        peer = await other.connect(listener.address, listener.key)
        assert peer.transports.startswith("nixl: UCX")
        assert other.agent.check_remote_metadata(listener.name)
    finally:
        await other.close()
        await listener.close()


async def test_bytes_land_exactly_once_and_a_matched_receive_outlives_cancel(pair: Pair) -> None:
    src = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    # Posted first, sender second.
    posted = pair.to_sender.post_recv(1, dst)
    await asyncio.wait_for(pair.to_receiver.send(1, src), WAIT_S)
    assert await posted.wait() and torch.equal(dst, src)
    posted.cancel()  # after completion: changes nothing
    assert await posted.wait()
    # Sender first: posting matches at once, so a cancel right after it cannot withdraw the receive.
    dst.zero_()
    sending = asyncio.ensure_future(pair.to_receiver.send(2, src))
    await _until(lambda: 2 in pair.to_sender._rts, "the RTS arrived")  # type: ignore[attr-defined]
    late = pair.to_sender.post_recv(2, dst)
    late.cancel()
    assert await asyncio.wait_for(late.wait(), WAIT_S) and torch.equal(dst, src)
    await asyncio.wait_for(sending, WAIT_S)


async def test_messages_sent_together_are_read_in_one_nixl_read(pair: Pair) -> None:
    """Eight receives posted at once into the non-contiguous slices of one pool, then eight sends at
    once (a session's chunk): their RTS frames leave together and the receiver reads all eight in one
    NIXL READ, one descriptor each, bit-exact; a receive posted later is a READ of its own."""
    src = torch.randint(0, 256, (32, 4096), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    rows = [3, 0, 9, 4, 17, 30, 12, 6]
    posted = [pair.to_sender.post_recv(200 + i, dst[r]) for i, r in enumerate(rows)]
    side = pair.recv_side
    before = (side.read_requests, side.messages_read)
    sends = [pair.to_receiver.send(200 + i, src[i]) for i in range(len(rows))]
    await asyncio.wait_for(asyncio.gather(*sends), WAIT_S)
    assert all([await p.wait() for p in posted])
    assert (side.read_requests, side.messages_read) == (before[0] + 1, before[1] + 8)
    for i, r in enumerate(rows):
        assert torch.equal(dst[r], src[i])
    later = pair.to_sender.post_recv(300, dst[31])
    await asyncio.wait_for(pair.to_receiver.send(300, src[31]), WAIT_S)
    assert await later.wait() and torch.equal(dst[31], src[31])
    assert side.read_requests == before[0] + 2


async def test_a_second_announcement_of_a_matched_message_drops_the_peer() -> None:
    """A broken (or hostile) sender announcing a message twice must not get a second READ into a
    receive that the first completes: the receiver drops the peer and fails the receive."""
    from kvtransfer.nixl import _RTS

    p = Pair(NixlSettings())
    await p.start()
    try:

        async def twice(dst: torch.Tensor) -> None:
            sender = p.to_receiver
            sender._write(_RTS, 7, 0, dst.numel())  # type: ignore[attr-defined]
            await sender._write(_RTS, 7, 0, dst.numel())  # type: ignore[attr-defined]  # one write, both

        await _assert_forged_rts_drops_the_peer(p, 7, twice, "a second RTS for message 0x7")
    finally:
        await p.close()


async def _assert_forged_rts_drops_the_peer(
    p: Pair, tag: int, forge: Callable[[torch.Tensor], Awaitable[None]], reason: str
) -> None:
    """The receiver posts a receive of `tag`, `forge(dst)` writes bad RTS frames from the sender's
    side: the receiver drops the peer for `reason`, the receive fails and nothing lands in it."""
    dst = torch.zeros(4096, dtype=torch.uint8)
    posted = p.to_sender.post_recv(tag, dst)
    await forge(dst)
    await _until(lambda: p.to_sender.lost, "the receiver dropped the peer")
    assert reason in (p.to_sender.lost_reason or "")
    with pytest.raises(TransportError):
        await asyncio.wait_for(posted.wait(), WAIT_S)
    assert int(dst.count_nonzero()) == 0


async def test_a_cancelled_receive_is_never_read_into(pair: Pair) -> None:
    src = torch.full((1 << 20,), 7, dtype=torch.uint8)
    dst = torch.zeros_like(src)
    posted = pair.to_sender.post_recv(3, dst)
    posted.cancel()
    assert not await posted.wait()
    sending = asyncio.ensure_future(pair.to_receiver.send(3, src))
    await _until(lambda: 3 in pair.to_sender._rts, "the RTS arrived")  # type: ignore[attr-defined]
    sending.cancel()  # the session's abort: WITHDRAWN, answered by DONE(taken=0)
    await asyncio.gather(sending, return_exceptions=True)
    await _until(lambda: not pair.to_receiver._sends, "the sender released its buffer")  # type: ignore[attr-defined]
    assert int(dst.count_nonzero()) == 0
    assert not pair.to_sender._rts  # type: ignore[attr-defined]


async def test_a_send_cancelled_while_its_read_is_in_flight_ends_on_both_sides(pair: Pair) -> None:
    """A fresh pair: the receiver's first READ needs the sender's side to answer its endpoint's
    wire-up, and the sender's session aborts (the send is cancelled) as its RTS goes out, before or
    while that READ is in flight. The sender keeps its buffer and progresses its agent until the
    receiver's DONE: the READ completes, the receive ends, the sender lets the buffer go. (A send
    cancelled before its RTS was written had never progressed, one cancelled after stopped at the
    cancel: the READ stayed in flight, 3 runs in 8 here, and both sides held their buffers for good.)"""
    src = torch.full((4 << 20,), 5, dtype=torch.uint8)
    dst = torch.zeros_like(src)
    posted = pair.to_sender.post_recv(4, dst)
    sending = asyncio.ensure_future(pair.to_receiver.send(4, src))
    await _until(lambda: 4 in pair.to_receiver._sends, "the send began")  # type: ignore[attr-defined]
    sending.cancel()  # the RTS is on its way: WITHDRAWN follows, the receiver's READ may start first
    await asyncio.gather(sending, return_exceptions=True)
    assert await asyncio.wait_for(posted.wait(), WAIT_S) and torch.equal(dst, src)
    await _until(lambda: not pair.to_receiver._sends, "the sender released its buffer")  # type: ignore[attr-defined]


async def test_registration_modes(pair: Pair) -> None:
    """storage: the pool's storage is registered once and stays; tensor: nothing outlives its message."""
    pool = torch.randint(0, 256, (16, 4096), dtype=torch.uint8)
    dst_pool = torch.zeros_like(pool)
    for i in range(8):
        posted = pair.to_sender.post_recv(100 + i, dst_pool[2 * i : 2 * i + 2])
        await asyncio.wait_for(pair.to_receiver.send(100 + i, pool[2 * i : 2 * i + 2]), WAIT_S)
        assert await posted.wait()
    assert torch.equal(dst_pool, pool)
    sender, receiver = pair.send_side.regions._live, pair.recv_side.regions._live
    if pair.send_side.settings.register == "storage":
        assert [key[1] for key in sender] == [pool.numel()] and [key[1] for key in receiver] == [pool.numel()]
    else:
        assert not sender and not receiver


async def test_receiver_side_close_fails_the_senders_wait(pair: Pair) -> None:
    sending = asyncio.ensure_future(pair.to_receiver.send(9, torch.ones(4096, dtype=torch.uint8)))
    await _until(lambda: 9 in pair.to_sender._rts, "the RTS arrived")  # type: ignore[attr-defined]
    await pair.to_sender.close()
    with pytest.raises(TransportError):
        await asyncio.wait_for(sending, WAIT_S)
    assert pair.to_receiver.lost and not pair.to_receiver._sends  # type: ignore[attr-defined]


def test_kvbench_measures_the_nixl_backend_beside_its_variants(tmp_path: Path) -> None:
    out = tmp_path / "rows.jsonl"
    argv = [
        "run",
        "--backend",
        "nixl,nixl-tensor",
        "--sizes",
        "256KiB",
        "--duration",
        "0.05",
        "--repeats",
        "1",
    ]
    argv += ["--ring-bytes", "8MiB", "--json", str(out), "--agent-log", str(tmp_path / "agents.log")]
    assert cli.main(argv) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["backend"] for r in rows] == ["nixl", "nixl-tensor"]
    assert all(r["verified"] is True and r["gbps"] > 0 for r in rows)
    assert all(r["transport"] == "nixl: UCX READ (receiver-pulled)" for r in rows)


async def test_a_peer_announcing_endless_unposted_messages_is_dropped() -> None:
    """Every RTS for a tag nobody posted is held for a later post, up to MAX_UNMATCHED_RTS; a peer
    past that is dropped as broken instead of growing the receiver's memory."""
    from kvtransfer.nixl import _RTS, MAX_UNMATCHED_RTS

    p = Pair(NixlSettings())
    await p.start()
    try:
        sender = p.to_receiver
        for tag in range(MAX_UNMATCHED_RTS):
            await sender._write(_RTS, tag + 1, 0, 1)  # type: ignore[attr-defined]
        await sender._write(_RTS, 1, 0, 1)  # type: ignore[attr-defined]  # a repeat is no new one
        held = p.to_sender._rts  # type: ignore[attr-defined]
        await _until(lambda: len(held) == MAX_UNMATCHED_RTS and not p.to_sender.lost, "all held")
        await sender._write(_RTS, MAX_UNMATCHED_RTS + 1, 0, 1)  # type: ignore[attr-defined]
        await _until(lambda: p.to_sender.lost, "the receiver dropped the peer")
        assert "nobody posted" in (p.to_sender.lost_reason or "")
    finally:
        await p.close()


def test_the_agent_a_metadata_blob_speaks_for_is_read_without_loading_it() -> None:
    from kvtransfer.nixl_memory import import_nixl, metadata_agent

    nixl = import_nixl()
    agent = nixl.nixl_agent("agent-one", nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    src = torch.zeros(4096, dtype=torch.uint8)
    registered = agent.register_memory([src])
    try:
        assert metadata_agent(agent.get_agent_metadata()) == "agent-one"
        partial = agent.get_partial_agent_metadata(registered, False)
        assert metadata_agent(partial) == "agent-one"
        for bad in (
            b"",
            b"nixlSerDes|Agent",
            partial[:20],
            partial.replace(b"agent-one|", b"agent-one#"),
            b"x" + partial,
        ):
            with pytest.raises(ValueError):
                metadata_agent(bad)
        too_long = b"nixlSerDes|Agent" + (1 << 40).to_bytes(8, "little") + b"a|"
        with pytest.raises(ValueError, match="malformed name"):
            metadata_agent(too_long)
    finally:
        agent.deregister_memory(registered)


async def test_metadata_of_another_agent_is_refused_before_it_is_loaded() -> None:
    """A peer may hand us NIXL metadata three ways (the pairing, an RTS, a pool key): each must be
    its own agent's. NIXL merges what `add_remote_agent` loads into the agent it names, so a blob
    of a third agent would rewire our reads of that agent: it is refused before it is loaded."""
    from kvtransfer.nixl import _RTS
    from kvtransfer.nixl_rma import NixlRegion
    from kvtransfer.ucx_rma import RmaError

    p = Pair(NixlSettings())
    third = NixlTransport(LAYOUT, NixlSettings())
    await p.start()
    await third.start()
    try:
        # the receiver knows the third agent (a second prefill worker, say): loading a blob of it
        # would succeed and merge, which is the danger
        await third.connect(p.recv_side.address, p.recv_side.key)
        await _until(lambda: p.recv_side.peer(third.address) is not None, "the third peer accepted")
        src = torch.ones(4096, dtype=torch.uint8)
        region = NixlRegion(third.rma, src)  # the third agent's pool key (device, its metadata)
        with pytest.raises(RmaError, match="names agent"):
            p.to_sender.unpack_rkey(region.rkey)  # type: ignore[attr-defined]
        region.close()

        # The pairing: a transport presenting the metadata of an agent the receiver already talks to.
        impostor = NixlTransport(LAYOUT, NixlSettings())
        await impostor.start()
        try:
            impostor.name, impostor.agent = p.send_side.name, p.send_side.agent
            refused = p.recv_side.refused["closed"]
            with pytest.raises(TransportError):
                await impostor.connect(p.recv_side.address, p.recv_side.key)
            await _until(lambda: p.recv_side.refused["closed"] > refused, "the receiver refused the impostor")
        finally:
            impostor.name, impostor.agent = "impostor", None  # the agent is the sender's: not ours to close
            await impostor.close()

        # An RTS whose registration is another agent's: the peer is dropped, nothing is read.
        third_blob = third.regions.acquire(src).metadata

        async def with_third_blob(dst: torch.Tensor) -> None:
            p.to_receiver._write(_RTS, 5, src.data_ptr(), dst.numel(), -1, third_blob)  # type: ignore[attr-defined]

        await _assert_forged_rts_drops_the_peer(
            p, 5, with_third_blob, "an RTS carried NIXL metadata of agent"
        )
    finally:
        await third.close()
        await p.close()
