"""What one process's NIXL agent holds: its memory registrations (`Regions`) and its READs in flight
(`Reads`). Owned by `kvtransfer.nixl.NixlTransport`; event-loop only."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import itertools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvtransfer.transport import as_bytes

MAX_IDLE_REGIONS = 32  # storage mode: idle registrations kept (LRU), e.g. recent staging buffers
_METADATA_HEAD = b"nixlSerDes|Agent"  # NIXL 1.5's serialized agent metadata starts with its name
MAX_AGENT_NAME = 256


def import_nixl() -> Any:
    """The NIXL Python API (`pip install 'splitserve[nixl]'`, i.e. nixl-cu12); ImportError says how
    to get it."""
    for name in ("nixl_cu12", "nixl"):  # the wheel's module, the meta package's
        with contextlib.suppress(ImportError):
            return importlib.import_module(name)
    raise ImportError("the nixl backend needs NIXL: pip install 'splitserve[nixl]' (nixl-cu12)")


def metadata_agent(metadata: bytes) -> str:
    """The agent name a NIXL metadata blob (full or partial) speaks for, read without loading it:
    `add_remote_agent` merges what it loads into whatever that agent already had, so a peer's blob
    is checked before it reaches our agent. ValueError when it is not NIXL 1.5's serialization
    (`nixlSerDes|Agent`, the name's length as 8 bytes little-endian, the name, `|`)."""
    head = len(_METADATA_HEAD)
    if not metadata.startswith(_METADATA_HEAD) or len(metadata) < head + 8:
        raise ValueError("not NIXL agent metadata")
    size = int.from_bytes(metadata[head : head + 8], "little")
    end = head + 8 + size
    if not 0 < size <= MAX_AGENT_NAME or metadata[end : end + 1] != b"|":
        raise ValueError(f"NIXL agent metadata with a malformed name ({size} bytes)")
    return metadata[head + 8 : end].decode(errors="replace")


@dataclass(eq=False)
class Region:
    """One NIXL registration; `owner` keeps its memory alive while registered."""

    key: tuple[int, int, int]  # (address, bytes, device or -1)
    serial: int  # unique per registration (an address registered again is a new region)
    reg: Any
    owner: Any
    metadata: bytes  # NIXL partial metadata a peer loads to read it
    users: int = 0


class Regions:
    """Registrations of this process's NIXL agent, refcounted by the operations using them."""

    def __init__(self, agent: Any, whole_storage: bool) -> None:
        self.agent, self.whole_storage = agent, whole_storage
        self._live: dict[tuple[int, int, int], Region] = {}
        self._idle: OrderedDict[tuple[int, int, int], Region] = OrderedDict()
        self._serials = itertools.count()

    def acquire(self, buf: torch.Tensor) -> Region:
        flat = as_bytes(buf)
        device = flat.get_device()
        if self.whole_storage:
            owner: Any = flat.untyped_storage()
            key = (owner.data_ptr(), owner.nbytes(), device)
        else:
            owner, key = flat, (flat.data_ptr(), flat.numel(), device)
        region = self._live.get(key)
        if region is None:
            mem = "DRAM" if device < 0 else "VRAM"
            reg = self.agent.register_memory([(key[0], key[1], max(device, 0), "")], mem)
            metadata = self.agent.get_partial_agent_metadata(reg, False)
            region = self._live[key] = Region(key, next(self._serials), reg, owner, metadata)
        self._idle.pop(key, None)
        region.users += 1
        return region

    def release(self, region: Region) -> None:
        region.users -= 1
        if region.users > 0:
            return
        self._idle[region.key] = region
        limit = MAX_IDLE_REGIONS if self.whole_storage else 0
        while len(self._idle) > limit:
            _, old = self._idle.popitem(last=False)
            del self._live[old.key]
            self.agent.deregister_memory(old.reg)

    def close(self) -> None:
        for region in self._live.values():
            self.agent.deregister_memory(region.reg)
        self._live.clear()
        self._idle.clear()


class Reads:
    """Watches this process's READs in flight: the event loop checks each one's state every turn
    while any is in flight (progressing NIXL when its progress thread is off), and never otherwise.
    With `progress_sends` (NIXL's progress thread off) it also progresses the agent every turn while
    a send of ours waits for its READ (`send_started`; a cancelled send until the receiver's DONE): the
    peer's READ needs our side's UCX worker to answer its endpoint's wireup, and without a thread
    nothing else would run it."""

    def __init__(self, agent: Any, progress_sends: bool = False) -> None:
        self.agent = agent
        self.progress_sends = progress_sends
        self._watched: dict[Any, Callable[[str], None]] = {}
        self._sending = 0
        self._task: asyncio.Task[None] | None = None

    def send_started(self) -> None:
        """A send of ours may be READ from now (its RTS goes out); `send_ended` once no READ of it can
        be in flight any more: its DONE came, or the peer is gone. Until then the agent is
        progressed, also after the send was cancelled: a READ the receiver started needs our side to
        complete, and the receiver waits for it before it answers."""
        self._sending += 1
        if self.progress_sends and self._task is None:
            self._task = asyncio.ensure_future(self._spin())

    def send_ended(self) -> None:
        self._sending -= 1

    def watch(self, handle: Any, state: str, callback: Callable[[str], None]) -> None:
        """Call `callback("DONE" | "ERR")` on the loop once the transfer ended."""
        if state != "PROC":
            asyncio.get_running_loop().call_soon(callback, state)
            return
        self._watched[handle] = callback
        if self._task is None:
            self._task = asyncio.ensure_future(self._spin())

    def forget(self, handle: Any) -> None:
        """Stop watching a transfer NIXL cancelled."""
        self._watched.pop(handle, None)

    async def _spin(self) -> None:
        try:
            while self._watched or (self.progress_sends and self._sending):
                if self.progress_sends and self._sending:
                    self.agent.get_new_notifs()  # progresses the agent's workers
                for handle, callback in list(self._watched.items()):
                    try:
                        state = self.agent.check_xfer_state(handle)
                    except Exception:  # NIXL's error for a failed transfer: its end
                        state = "ERR"
                    if state != "PROC":
                        del self._watched[handle]
                        callback(state)
                await asyncio.sleep(0)
        finally:
            self._task = None
