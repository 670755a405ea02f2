"""One-sided UCX RMA through ctypes on the libucp that UCXX bundles (UCX 1.21's ABI, checked).

The UCXX Python binding exposes no RMA, so this module calls UCP directly on UCXX's own context and
worker (`ucp_context_h` / `ucp_worker_h` handles of `ucxx.core._get_ctx()`) and on an endpoint's
`ucp_ep_h` (`endpoint.ucp_endpoint`):

- `MemRegion`: memory this process lets peers read (`ucp_mem_map`) and its packed remote key
  (`ucp_rkey_pack`). The creator owns it and `close()`s it (`ucp_mem_unmap`) after every peer that
  may still read it is done.
- `RemoteKey`: a peer's packed key unpacked on one endpoint (`ucp_ep_rkey_unpack`); the reader owns
  it and `close()`s it (`ucp_rkey_destroy`) before that endpoint is closed.
- `Rma.get(ep, runs)`: posts one `ucp_get_nbx` per run at once and returns a future that completes
  once every get finished. Posting is one call into kvtransfer/csrc/rma_wake.c (`rma_get`), and
  completion never spins and takes no GIL off the loop: each pending get carries that library's C
  callback, which UCP calls from whichever thread progresses the worker (UCXX's progress thread,
  or the event loop in UCXX's polling modes); the batch's last one queues it and writes an eventfd
  the loop watches. A get that returns a request moves its bytes in a later progress: for a batch
  of at most `INLINE_PROGRESS_BYTES`, `rma_get` first progresses the worker itself while UCP makes
  headway (never past a call that found nothing to do, so it does not spin), which over CMA does the
  copy on the poster, and a batch finished there is resolved at once, never queued; otherwise, or
  when that did not finish it, `rma_get` signals the worker (`ucp_worker_signal`) to wake UCXX's
  progress thread out of epoll at once. Gets are posted from the loop thread while the progress
  thread progresses: that needs a worker in UCS_THREAD_MODE_MULTI, which `Rma` checks at creation.

Cancelling an RMA get is not something UCP offers: a caller that gives up must still await the
future before the destination memory is reused (kvtransfer.pull does).
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass

import structlog
import torch

from kvtransfer.errors import TransportError
from kvtransfer.rma_wake import DONE_INLINE, PENDING, CBatch, CRun, CUcp, CWake, address, bind, native

log = structlog.get_logger(__name__)

UCP_VERSION = (1, 21)  # the struct layouts below and in rma_wake.c are UCX 1.21's (include/ucp/api/ucp.h)
_THREAD_MODE_MULTI = 2
_MEM_MAP_FIELDS = 0b1011  # ADDRESS | LENGTH | PROT
_PROT_LOCAL_RW_REMOTE_READ = (1 << 0) | (1 << 1) | (1 << 8)
# A batch of at most this many bytes is progressed by its poster while UCP makes headway (0: never;
# SPLITSERVE_RMA_INLINE_BYTES overrides it, for measurements), at most INLINE_PROGRESS_CALLS calls:
# UCX copies UCX_CMA_SEG_SIZE a call over CMA (4 MiB: kvtransfer.ucx), so 16 MiB takes 4 (32 at
# UCX's default of 512 KiB, where these bounds were chosen). 16 MiB, not 4: ratio
# to NIXL at 16 MiB 0.975 against 0.90 over 28 rounds each (docs/kvtransfer.md, "Ring buffers on
# huge pages"); it holds the event loop for the copy, 1.6-3 ms at 16 MiB on this host.
INLINE_PROGRESS_BYTES = int(os.environ.get("SPLITSERVE_RMA_INLINE_BYTES", str(16 << 20)))
INLINE_PROGRESS_CALLS = 64


class _MemMapParams(ctypes.Structure):
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("address", ctypes.c_void_p),
        ("length", ctypes.c_size_t),
        ("flags", ctypes.c_uint),
        ("prot", ctypes.c_uint),
        ("memory_type", ctypes.c_int),
        ("exported_memh_buffer", ctypes.c_void_p),
    ]


class _WorkerAttr(ctypes.Structure):
    _fields_ = [("field_mask", ctypes.c_uint64), ("thread_mode", ctypes.c_int), ("rest", ctypes.c_byte * 256)]


class RmaError(TransportError):
    """A UCP RMA call failed (the status name says why)."""


class _Ucp:
    """The libucp functions used here, loaded once per process."""

    def __init__(self) -> None:
        import libucx

        lib = ctypes.CDLL(os.path.join(os.path.dirname(libucx.__file__), "lib", "libucp.so.0"))
        vp, st = ctypes.c_void_p, ctypes.c_int
        major, minor, release = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
        bind(lib, "ucp_get_version", None, vp, vp, vp)(
            ctypes.byref(major), ctypes.byref(minor), ctypes.byref(release)
        )
        if (major.value, minor.value) != UCP_VERSION:
            raise RmaError(f"libucp {major.value}.{minor.value}: RMA structs are laid out for {UCP_VERSION}")
        self.status_string = bind(lib, "ucs_status_string", ctypes.c_char_p, st)
        self.worker_query = bind(lib, "ucp_worker_query", st, vp, vp)
        self.mem_map = bind(lib, "ucp_mem_map", st, vp, vp, vp)
        self.mem_unmap = bind(lib, "ucp_mem_unmap", st, vp, vp)
        self.rkey_pack = bind(lib, "ucp_rkey_pack", st, vp, vp, vp, vp)
        self.rkey_buffer_release = bind(lib, "ucp_rkey_buffer_release", None, vp)
        self.ep_rkey_unpack = bind(lib, "ucp_ep_rkey_unpack", st, vp, vp, vp)
        self.rkey_destroy = bind(lib, "ucp_rkey_destroy", None, vp)
        self.get_nbx = lib.ucp_get_nbx  # called from rma_wake.c only
        self.request_free = lib.ucp_request_free  # called from rma_wake.c only
        self.worker_signal = lib.ucp_worker_signal  # called from rma_wake.c only
        self.worker_progress = lib.ucp_worker_progress  # called from rma_wake.c only

    def check(self, status: int, what: str) -> None:
        if status != 0:
            raise RmaError(f"{what}: {self.status_string(status).decode()}")


@functools.cache
def _lib() -> _Ucp:
    return _Ucp()


class MemRegion:
    """`tensor`'s bytes mapped for remote reads; `rkey` is the packed key a reader unpacks.

    Holds a reference to the tensor, so its memory outlives the mapping."""

    def __init__(self, context: int, tensor: torch.Tensor) -> None:
        ucp = _lib()
        self._context, self._tensor = context, tensor
        self.address, self.length = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        params = _MemMapParams(_MEM_MAP_FIELDS, self.address, self.length, 0, _PROT_LOCAL_RW_REMOTE_READ)
        memh = ctypes.c_void_p()
        ucp.check(ucp.mem_map(context, ctypes.byref(params), ctypes.byref(memh)), "ucp_mem_map")
        self.memh: int | None = memh.value
        buf, size = ctypes.c_void_p(), ctypes.c_size_t()
        try:
            ucp.check(ucp.rkey_pack(context, memh, ctypes.byref(buf), ctypes.byref(size)), "ucp_rkey_pack")
        except RmaError:
            self.close()
            raise
        self.rkey = ctypes.string_at(buf, size.value)
        ucp.rkey_buffer_release(buf)

    def close(self) -> None:
        """Unmap (idempotent). On RDMA a key of this region stops working; see docs/kvtransfer.md
        for what shared memory and CMA do instead."""
        if self.memh is not None:
            memh, self.memh = self.memh, None
            _lib().check(_lib().mem_unmap(self._context, memh), "ucp_mem_unmap")


class RemoteKey:
    """A peer's packed key unpacked on endpoint `ep` (a `ucp_ep_h`)."""

    def __init__(self, ep: int, packed: bytes) -> None:
        rkey = ctypes.c_void_p()
        _lib().check(_lib().ep_rkey_unpack(ep, packed, ctypes.byref(rkey)), "ucp_ep_rkey_unpack")
        self.ep, self.handle = ep, rkey.value

    def close(self) -> None:
        if self.handle is not None:
            handle, self.handle = self.handle, None
            _lib().rkey_destroy(handle)


@dataclass(frozen=True, slots=True)
class GetRun:
    """Copy `nbytes` from the peer's `remote_addr` to our `local_addr` (one ucp_get_nbx)."""

    local_addr: int
    remote_addr: int
    nbytes: int


class _Batch:
    """Gets of one `Rma.get` call that its poster did not finish. `c` is their UCP user_data; the
    Rma holds this object (so `c`'s memory) until the C callback of the last get queued it and the
    loop drained it."""

    __slots__ = ("c", "future")

    def __init__(self, c: CBatch, future: asyncio.Future[None]) -> None:
        self.c, self.future = c, future

    def resolve(self) -> None:
        if self.future.done():  # the caller cancelled its wait; the gets still had to finish
            return
        if self.c.status:
            self.future.set_exception(_failure(self.c.status))
        else:
            self.future.set_result(None)


def _failure(status: int) -> RmaError:
    return RmaError(f"ucp_get_nbx: {_lib().status_string(status).decode()}")


class Rma:
    """RMA on UCXX's context and worker; one per process, created on the event loop after
    `ucxx.init` (kvtransfer.ucx.UcxTransport.rma), closed (`await close()`) by the transport after
    its endpoints: that fails what is still in flight, and close waits for those completions."""

    def __init__(self, context: int, worker: int) -> None:
        ucp = _lib()
        attr = _WorkerAttr(field_mask=1)
        ucp.check(ucp.worker_query(worker, ctypes.byref(attr)), "ucp_worker_query")
        if attr.thread_mode != _THREAD_MODE_MULTI:
            raise RmaError(f"the UCX worker is in thread mode {attr.thread_mode}, RMA needs MULTI")
        self.context, self.worker = context, worker
        self._native = native()
        self._loop = asyncio.get_running_loop()
        self._efd: int | None = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._wake = CWake(None, address(ucp.request_free), self._efd, 0)
        self._wake_address = ctypes.addressof(self._wake)
        self._ucp = CUcp(*(address(f) for f in (ucp.get_nbx, ucp.worker_progress, ucp.worker_signal)), worker)
        self._ucp_address = ctypes.addressof(self._ucp)
        self._runs = (CRun * 16)()  # `get`'s runs for rma_get, grown on demand (loop thread only)
        self._batches: dict[int, _Batch] = {}  # by the address of their C struct
        self.completed_inline = 0  # batches their poster's progress finished (the rest: progress thread)
        self._drained = asyncio.Event()
        self._succeeded: asyncio.Future[None] = self._loop.create_future()  # what a batch finished
        self._succeeded.set_result(None)  # here without error returns: done, shared, never reset
        self._loop.add_reader(self._efd, self._drain)

    @property
    def pending(self) -> int:
        """Batches whose gets have not all completed."""
        return len(self._batches)

    def register(self, tensor: torch.Tensor) -> MemRegion:
        """Map `tensor` (contiguous, host memory) for remote reads; the caller closes the region."""
        if not tensor.is_contiguous():
            raise ValueError("an RMA region must be contiguous")
        return MemRegion(self.context, tensor)

    def serve(self, delta: int, linger_s: float = 0.0) -> None:
        """A pull session a peer may read our memory in starts (+1) or ends (-1). Nothing to do:
        UCXX's progress thread answers a reader's wire-up (kvtransfer.nixl_rma has to)."""

    def _drain(self) -> None:
        """The eventfd's reader: resolve every batch the C callback finished."""
        head = self._native.drain(ctypes.byref(self._wake))
        while head:
            address, head = head, self._batches[head].c.next
            self._finish(address)

    def _finish(self, address: int) -> None:
        """Forget the finished batch whose C struct is at `address` and resolve its future."""
        batch = self._batches.pop(address)
        if not self._batches:
            self._drained.set()
        batch.resolve()

    def get(
        self, rkey: RemoteKey, runs: Sequence[GetRun], local: MemRegion | None = None
    ) -> asyncio.Future[None]:
        """Post every run's get on `rkey`'s endpoint now; the future completes when all finished
        (RmaError if any failed). Await it before reusing the destination memory, even on abort
        (cancelling the future does not stop the gets). `local`, when given, is the registered
        region the destinations lie in (saves UCP a lookup). A batch finished before this returns
        gets an already-resolved future that may be shared with other such batches: never cancel
        or compare it by identity."""
        if rkey.handle is None:
            raise RmaError("get on a destroyed remote key")
        if self._efd is None:
            raise RmaError("get on a closed Rma")
        c = CBatch(None, self._wake_address, len(runs) + 1, 0)  # +1: the poster's, until it let go
        address = ctypes.addressof(c)
        if len(runs) > len(self._runs):
            self._runs = (CRun * len(runs))()
        c_runs = self._runs
        for i, run in enumerate(runs):
            c_runs[i] = CRun(run.local_addr, run.remote_addr, run.nbytes)
        memh = local.memh if local is not None else None
        done = self._native.get(
            address, self._ucp_address, rkey.ep, rkey.handle, memh, c_runs, len(runs),
            INLINE_PROGRESS_BYTES, INLINE_PROGRESS_CALLS,
        )  # fmt: skip
        if done > PENDING:  # finished here, never queued: nothing to track
            self.completed_inline += done == DONE_INLINE
            if not c.status:
                return self._succeeded
            failed = self._loop.create_future()
            failed.set_exception(_failure(c.status))
            return failed
        # Registered only now: a completion may already have queued it, but the queue is drained
        # on this thread, after we return.
        batch = _Batch(c, self._loop.create_future())
        self._batches[address] = batch
        self._drained.clear()
        if done < PENDING:
            # Without the signal the gets still complete (at the progress thread's epoll timeout),
            # so a failure is logged, not raised.
            log.warning("ucp_worker_signal failed", status=_lib().status_string(done).decode())
        return batch.future

    async def close(self) -> None:
        """Wait until every posted get completed (close the endpoints first, so that none can be
        left waiting on a peer), then stop watching and close the eventfd. Idempotent."""
        if self._efd is None:
            return
        if self._batches:
            await self._drained.wait()
        efd, self._efd = self._efd, None
        self._loop.remove_reader(efd)
        self._native.quiesce(ctypes.byref(self._wake))
        os.close(efd)
