"""Host buffers on transparent huge pages: same contract as torch.zeros, huge-page backed when THP allows."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from kernels import host_memory

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def anon_huge_kib(address: int) -> int:
    """AnonHugePages (KiB) of the mapping of this process that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            inside = int(span.group(1), 16) <= address < int(span.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_small_buffers_are_plain_zeros() -> None:
    t = host_memory.zeros((3, 5), torch.float16)
    assert t.shape == (3, 5) and t.dtype == torch.float16 and not t.any()


def test_large_buffer_is_zeroed_aligned_and_writable() -> None:
    t = host_memory.zeros((4, 3, 1 << 18), torch.float32)  # 12 MiB
    assert t.shape == (4, 3, 1 << 18) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % host_memory.HUGE_PAGE_BYTES == 0
    assert not t.any()
    t[1, 2].fill_(1.5)
    assert t.sum().item() == 1.5 * (1 << 18)


@pytest.mark.skipif(
    not THP_MODE.exists() or "[never]" in THP_MODE.read_text(), reason="transparent huge pages are off"
)
def test_large_buffer_gets_huge_pages() -> None:
    t = host_memory.zeros((16 << 20,), torch.uint8)
    assert anon_huge_kib(t.data_ptr()) >= 8 << 10  # at least half of the 16 MiB, faulted in already
