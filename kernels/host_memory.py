"""Large, long-lived host buffers (KV caches, transfer rings) on 2 MiB transparent huge pages.

Why: a block gather or an attention kernel walking a multi-GiB KV cache misses the TLB far less
with 2 MiB pages, and a copy between processes (UCX's CMA single copy, `process_vm_readv`) looks up
every page it touches: 16384 lookups for a 64 MiB message with 4 KiB pages, 32 with huge pages.
Measured in docs/kvtransfer.md ("What got it there"). numpy already asks for huge pages for its large
arrays; torch's CPU allocator does not unless `THP_MEM_ALLOC_ENABLE=1` is set for the whole process.

Ownership: the returned tensor owns its anonymous mapping (through `torch.frombuffer`); the mapping
is unmapped when the last tensor viewing it is freed. Every page is faulted in at allocation (as
`torch.zeros` does), so a cache that does not fit fails at start rather than mid-serving, and no
step pays for first touches. Where the kernel's THP mode is `never` the buffer simply gets
ordinary pages.
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE_BYTES = 2 << 20


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.Tensor:
    """Like `torch.zeros(shape, dtype=dtype, device=device)`; CPU tensors of at least one huge page
    start on a huge-page boundary in memory advised for huge pages (`MADV_HUGEPAGE`)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes < HUGE_PAGE_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    # private: a shared anonymous mapping is shmem, which THP leaves alone by default
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # holds a reference to the mapping
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    return raw[offset : offset + nbytes].zero_().view(dtype).view(shape)  # zero_(): fault in now
