"""Host buffers on transparent huge pages: same contract as torch.zeros, huge-page backed when THP allows."""

from __future__ import annotations

import mmap

import pytest
import structlog
import torch

from kernels import host_memory


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


@pytest.mark.skipif(host_memory.thp_mode() in (None, "never"), reason="transparent huge pages are off")
def test_large_buffer_gets_huge_pages_and_says_so() -> None:
    t = host_memory.zeros((16 << 20,), torch.uint8)
    with structlog.testing.capture_logs() as lines:
        share = host_memory.report_backing(t, "kv cache")
    assert share is not None and share >= 0.5  # at least half of the 16 MiB, faulted in already
    assert [(e["log_level"], e["buffer"]) for e in lines] == [("info", "kv cache")]


def test_a_buffer_on_small_pages_is_reported_with_the_fix() -> None:
    """What a node with THP off gives a KV cache: the share is 0 and the start-up log says what to set."""
    mapping = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_NOHUGEPAGE)
    t = torch.frombuffer(mapping, dtype=torch.uint8).zero_()
    assert host_memory.huge_page_share(t) == 0.0
    with structlog.testing.capture_logs() as lines:
        assert host_memory.report_backing(t, "kv cache") == 0.0
    assert [e["log_level"] for e in lines] == ["warning"]
    assert "transparent_hugepage/enabled" in lines[0]["fix"] and lines[0]["bytes"] == 8 << 20
    del t
    mapping.close()


def test_device_tensors_have_no_host_backing() -> None:
    assert host_memory.huge_page_share(torch.empty(4, device="meta")) is None
    assert host_memory.thp_mode() in {None, "always", "madvise", "never"}
