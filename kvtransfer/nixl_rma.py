"""One-sided reads on the NIXL backend: what `kvtransfer.pull` asks of a transport, as NIXL READs.

The same three pieces as `ucx_rma` (`register`, a peer's `unpack_rkey`, `get`), so a decode worker
on `--transfer-backend nixl` (pulling is its `--kv-transfer-mode auto`) reads the prompt's KV
straight out of the prefill worker's pool into the blocks it reserved, as vLLM's NIXL connector does:

- P registers its whole cache with its agent once (`NixlRma.register`, the worker's `MappedPool`);
  the region's "remote key" is NIXL's partial agent metadata of that registration, which D gets
  only over the authenticated control plane (KVChunkReady's pool source).
- D loads it into its agent (`NixlPeer.unpack_rkey`: it must name the agent of the peer it came
  over) and reads each chunk's runs with one NIXL READ, one descriptor pair per run
  (`NixlRma.get`), completed by the event loop's READ watcher (`nixl_memory.Reads`).

With NIXL's progress thread off (the default), nothing would progress P's agent while D reads, and
the first READ's endpoint wire-up needs P's side to answer (as the push's first READ did, session
20); so while P holds a pull session (`MappedPool.hold`: from Reserved to KVAck) its loop
progresses the agent every PROGRESS_TICK_S, and not otherwise (an idle P that ticked for life used
4% of a core; D, which only reads, never ticks). An aborted session keeps the ticks going for its
lease after it ended: D may have READs in flight it posted before it heard of the abort, and it
waits for every one of them before it frees its blocks (a READ left without P's progress never
completed, and D's blocks stayed held for good); D posts none later than its own lease allows.
"""

from __future__ import annotations

import asyncio
import struct
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvtransfer.nixl_memory import Region
from kvtransfer.ucx_rma import GetRun, RmaError

if TYPE_CHECKING:
    from kvtransfer.nixl import NixlTransport

PROGRESS_TICK_S = 0.001
_DEVICE = struct.Struct("<i")  # a packed key: the pool's device (-1: host), then NIXL's metadata


def mem_type(device: bool) -> str:
    """NIXL's memory type of a buffer on a GPU (`device`) or in host memory."""
    return "VRAM" if device else "DRAM"


class NixlRegion:
    """`tensor`'s storage registered with the agent for remote reads; `rkey` is what a reader
    loads (the device, then NIXL's metadata of the registration). Closed by the owner (the
    worker's `MappedPool`)."""

    def __init__(self, rma: NixlRma, tensor: torch.Tensor) -> None:
        self._rma = rma
        self._region: Region | None = rma.transport.regions.acquire(tensor)
        self.device = tensor.get_device()
        self.rkey = _DEVICE.pack(self.device) + self._region.metadata
        self.address, self.length = tensor.data_ptr(), tensor.numel() * tensor.element_size()

    def close(self) -> None:
        """Release the registration (idempotent)."""
        if self._region is not None:
            region, self._region = self._region, None
            self._rma.transport.regions.release(region)


def unpack_key(packed: bytes) -> tuple[int, bytes]:
    """(device, NIXL metadata) of a packed key; ValueError when it is too short to be one."""
    if len(packed) <= _DEVICE.size:
        raise ValueError(f"a NIXL pool key of {len(packed)} bytes")
    return _DEVICE.unpack_from(packed)[0], packed[_DEVICE.size :]


class NixlRemoteKey:
    """A peer's pool loaded into our agent: READs name its agent `remote`. `close` ends this key's
    use (the session's); NIXL keeps the agent's metadata for the peer's other sessions."""

    def __init__(self, remote: str, device: int) -> None:
        self.remote, self.device = remote, device
        self.handle: str | None = remote

    def close(self) -> None:
        self.handle = None


class NixlRma:
    """This process's NIXL READs of peers' registered memory; owned by its `NixlTransport`."""

    def __init__(self, transport: NixlTransport) -> None:
        self.transport = transport
        self._serving = 0  # pull sessions a peer may be reading in (`serve`)
        self._linger_until = 0.0  # loop time: keep progressing until then with no session served
        self._tick: asyncio.TimerHandle | None = None
        self._reading: Counter[str] = Counter()  # remote agent -> READs of ours in flight from it
        self._forget: set[str] = set()  # remote agents to forget once their READs ended

    def reading_from(self, remote: str) -> bool:
        return self._reading[remote] > 0

    def forget_when_done(self, remote: str) -> None:
        """The peer is gone: forget its agent once no READ of ours from it is in flight."""
        self._forget.add(remote)

    def register(self, tensor: torch.Tensor) -> NixlRegion:
        """Register `tensor` (contiguous) for remote reads; the caller closes the region."""
        if not tensor.is_contiguous():
            raise ValueError("an RMA region must be contiguous")
        return NixlRegion(self, tensor)

    def serve(self, delta: int, linger_s: float = 0.0) -> None:
        """Count the pull sessions a peer may be reading our memory in (+1 when one starts, -1 when
        it ends; an ending one passes `linger_s`, how long its reader may still have READs in
        flight); while any is, or lingers, and NIXL's own thread is off, the agent is progressed
        every tick (see the module docstring)."""
        loop = asyncio.get_running_loop()
        self._serving += delta
        self._linger_until = max(self._linger_until, loop.time() + linger_s)
        if self._serving > 0 and self._tick is None and not self.transport.settings.progress_thread:
            self._tick = loop.call_later(PROGRESS_TICK_S, self._progress)
        elif not self._needs_progress(loop) and self._tick is not None:
            self._tick.cancel()
            self._tick = None

    @property
    def progressing(self) -> bool:
        """Whether this loop progresses the agent now (a pull session served or lingering)."""
        return self._tick is not None

    def _needs_progress(self, loop: asyncio.AbstractEventLoop) -> bool:
        return self._serving > 0 or loop.time() < self._linger_until

    def _progress(self) -> None:
        self.transport.agent.get_new_notifs()  # progresses the agent's UCX workers
        loop = asyncio.get_running_loop()
        self._tick = loop.call_later(PROGRESS_TICK_S, self._progress) if self._needs_progress(loop) else None

    def get(
        self, rkey: NixlRemoteKey, runs: Sequence[GetRun], local: NixlRegion | None = None
    ) -> asyncio.Future[None]:
        """One NIXL READ of every run from `rkey`'s agent into our memory registered with this
        agent (`local`: its region, whose device both sides' pools share); the future completes when
        it finished (RmaError if it failed). Await it before reusing the destinations, even on abort."""
        if rkey.handle is None:
            raise RmaError("get on a destroyed remote key")
        agent, future = self.transport.agent, asyncio.get_running_loop().create_future()
        device = local.device if local is not None else -1
        here, there = mem_type(device >= 0), mem_type(rkey.device >= 0)
        handle = None
        try:
            handle = agent.initialize_xfer(  # NIXL checks every remote descriptor lies inside a
                "READ",  # registration the peer's metadata announced, else it raises
                agent.get_xfer_descs([(r.local_addr, r.nbytes, max(device, 0)) for r in runs], here),
                agent.get_xfer_descs([(r.remote_addr, r.nbytes, max(rkey.device, 0)) for r in runs], there),
                rkey.handle,
            )
            state = agent.transfer(handle)
        except Exception as e:  # a descriptor outside the peer's registration, a refused READ
            if handle is not None:
                handle.release()
            raise RmaError(f"NIXL READ not started: {e!r}") from e
        remote = rkey.remote
        self._reading[remote] += 1

        def ended(state: str) -> None:
            self._reading[remote] -= 1
            error = None if state == "DONE" else f"NIXL READ of {len(runs)} run(s) failed"
            try:
                handle.release()
            except Exception as e:  # NIXL keeps a handle it cannot free; nothing more will land
                error = error or f"NIXL READ handle not released: {e!r}"
            if not self._reading[remote]:
                del self._reading[remote]
                if remote in self._forget:
                    self._forget.discard(remote)
                    self.transport.forget_remote(remote)
            if future.done():
                return
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(RmaError(error))

        self.transport.reads.watch(handle, state, ended)
        return future

    def close(self) -> None:
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None
