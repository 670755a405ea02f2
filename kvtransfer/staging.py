"""Staging buffers of packed messages, reused across messages and sessions.

A packed message (kvtransfer.plan) travels through a staging buffer: the sender gathers scattered
source blocks into one, the receiver receives into one and scatters. A fresh allocation per
message is what made push transfers slow: a few MiB from the allocator is a fresh mapping whose
every 4 KiB page faults on the gather's first touch (and, with NIXL, a new registration its peer
must load), about 3 ms a 5 MiB message on a 2-core VM against 0.2 ms for the gather itself
(docs/kvtransfer.md "Staging buffers reused"). `StagingPool` keeps them instead: buffers on huge
pages (`kernels.host_memory`, faulted in once), in power-of-two block counts, lent and given back.

Ownership: `take(n)` lends a buffer of n blocks to the caller, who gives it back with `give()` only
once nothing touches it any more: a send that returned (delivered), a receive whose `wait()` returned
(landed and scattered, or withdrawn unread). A buffer the transport may still use (a cancelled
send the peer may be reading, a receive that failed) is never given back; it is dropped and freed
once the last reference goes. Idle buffers are kept up to `max_idle_bytes` per pool, oldest freed
first. One pool per (device, dtype, block shape) per process (`pool_for`); thread-safe.

On a GPU, kernels run in stream order but transports touch device memory outside it: a buffer
given back records an event on the current stream (a scatter out of it may still be queued), and
`take` lends it again only once that event completed; `queued_work_done` is what a sender waits
on between its gather and the send.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from kernels import host_memory

MAX_IDLE_BYTES = 256 << 20  # per pool: a few sessions' packed messages in flight


class StagingPool:
    """Reusable `[capacity, *block_shape]` buffers of one dtype and device (see module docstring)."""

    def __init__(
        self,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        max_idle_bytes: int = MAX_IDLE_BYTES,
    ) -> None:
        self.block_shape, self.dtype, self.device = block_shape, dtype, device
        self.max_idle_bytes = max_idle_bytes
        # id(buffer) -> (buffer, the event after the last device work queued on it), oldest first
        self._idle: OrderedDict[int, tuple[torch.Tensor, torch.cuda.Event | None]] = OrderedDict()
        self._idle_bytes = 0
        self._lent: dict[int, torch.Tensor] = {}  # data_ptr of a lent view -> its whole buffer
        self._lock = threading.Lock()
        self.allocated = 0  # buffers made, for tests and metrics

    def take(self, num_blocks: int) -> torch.Tensor:
        """A contiguous `[num_blocks, *block_shape]` view of a buffer lent to the caller."""
        if num_blocks < 1:
            raise ValueError(f"a staging buffer holds at least one block, not {num_blocks}")
        capacity = 1 << (num_blocks - 1).bit_length()
        with self._lock:
            idle = self._take_idle(capacity)
            if idle is None:
                self.allocated += 1
        if idle is None:
            buffer = self._new(capacity)
        else:
            buffer, queued = idle
            if queued is not None:
                queued.synchronize()  # a scatter out of it, queued before it came back, is done
        view = buffer[:num_blocks]
        with self._lock:
            self._lent[view.data_ptr()] = buffer
        return view

    def give(self, view: torch.Tensor) -> None:
        """Give back a view `take` lent, once nothing touches it (see module docstring)."""
        with self._lock:
            buffer = self._lent.pop(view.data_ptr(), None)
            if buffer is None:
                raise ValueError("give() of a buffer this pool did not lend (or already given back)")
            queued = None
            if buffer.is_cuda:
                queued = torch.cuda.Event()
                queued.record(torch.cuda.current_stream(buffer.device))
            self._idle[id(buffer)] = (buffer, queued)
            self._idle_bytes += _nbytes(buffer)
            while self._idle_bytes > self.max_idle_bytes:
                _, (old, _) = self._idle.popitem(last=False)
                self._idle_bytes -= _nbytes(old)

    def drop(self, view: torch.Tensor) -> None:
        """Forget a lent view that must not be reused (the transport may still touch it): it is
        freed once its last reference goes."""
        with self._lock:
            self._lent.pop(view.data_ptr(), None)

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes

    @property
    def lent(self) -> int:
        """Buffers lent and neither given back nor dropped: 0 at quiescence."""
        return len(self._lent)

    def _take_idle(self, capacity: int) -> tuple[torch.Tensor, torch.cuda.Event | None] | None:
        for key, idle in self._idle.items():
            if idle[0].shape[0] == capacity:
                del self._idle[key]
                self._idle_bytes -= _nbytes(idle[0])
                return idle
        return None

    def _new(self, capacity: int) -> torch.Tensor:
        shape = (capacity, *self.block_shape)
        if self.device.type == "cpu":
            return host_memory.zeros(shape, self.dtype)
        return torch.empty(shape, dtype=self.dtype, device=self.device)


def _nbytes(buffer: torch.Tensor) -> int:
    return buffer.numel() * buffer.element_size()


def queued_work_done(buffer: torch.Tensor) -> None:
    """Wait until the device work queued on `buffer`'s GPU (a gather into it) is done, before a
    transport reads it outside the stream's order; nothing to wait for on the CPU."""
    if buffer.is_cuda:
        torch.cuda.current_stream(buffer.device).synchronize()


_pools: dict[tuple[str, torch.dtype, tuple[int, ...]], StagingPool] = {}
_pools_lock = threading.Lock()


def pool_for(cache: torch.Tensor) -> StagingPool:
    """This process's staging pool for blocks of `cache` (`[num_blocks, *block_shape]`)."""
    key = (str(cache.device), cache.dtype, tuple(cache.shape[1:]))
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = StagingPool(key[2], cache.dtype, cache.device)
        return pool
