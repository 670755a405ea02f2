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
ordinary pages; `report_backing` says so (the workers call it for their KV cache at start).
"""

from __future__ import annotations

import math
import mmap
import re
from pathlib import Path

import structlog
import torch

log = structlog.get_logger(__name__)

HUGE_PAGE_BYTES = 2 << 20
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_SMAPS = Path("/proc/self/smaps")
_SPAN = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) ")
# below this share of huge pages a long-lived buffer is reported with what to fix
HUGE_PAGE_WARN_SHARE = 0.5


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


def thp_mode() -> str | None:
    """The kernel's transparent huge page mode (`always`, `madvise`, `never`); None where unknown."""
    try:
        chosen = re.search(r"\[(\w+)\]", THP_ENABLED.read_text())
    except OSError:
        return None
    return chosen.group(1) if chosen else None


def huge_page_share(tensor: torch.Tensor) -> float | None:
    """How much of a host tensor's bytes its mapping has on huge pages (AnonHugePages in
    /proc/self/smaps over the tensor's size, at most 1); None for device tensors or without smaps."""
    if tensor.device.type != "cpu":
        return None
    address, inside = tensor.data_ptr(), False
    try:
        lines = _SMAPS.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if span := _SPAN.match(line):
            inside = int(span.group(1), 16) <= address < int(span.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return min(1.0, int(line.split()[1]) * 1024 / max(1, tensor.nbytes))
    return None


def report_backing(tensor: torch.Tensor, what: str) -> float | None:
    """Log how much of `what` (a long-lived host buffer: the KV cache) is on huge pages, and warn
    with the fix when it is under HUGE_PAGE_WARN_SHARE: on 4 KiB pages a copy between processes
    walks 512 times as many pages (kvbench measured half the bandwidth at 1 MiB messages) and
    every block gather misses the TLB more. Returns the share (None where unknown)."""
    share = huge_page_share(tensor)
    if share is None:
        return None
    if share < HUGE_PAGE_WARN_SHARE and tensor.nbytes >= HUGE_PAGE_BYTES:
        log.warning(
            "host buffer is mostly on 4 KiB pages",
            buffer=what, bytes=tensor.nbytes, huge_page_share=round(share, 3), thp_mode=thp_mode(),
            fix="set /sys/kernel/mm/transparent_hugepage/enabled to madvise or always on this node "
            "(and defrag to madvise so faults compact); docs/kvtransfer.md, 'Ring buffers on huge pages'",
        )  # fmt: skip
    else:
        log.info("host buffer backing", buffer=what, bytes=tensor.nbytes, huge_page_share=round(share, 3))
    return share
