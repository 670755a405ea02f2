"""kernels.bench runs end to end (tiny shapes; on CPU the Triton side is interpreted)."""

from __future__ import annotations

import pytest
import torch

from kernels.bench import TINY, main, measure
from tests.kernels.conftest import DEVICE


def test_measure_reports_every_kernel_with_matching_outputs() -> None:
    rows = measure(TINY, torch.device(DEVICE))
    assert [r.name.split()[0] for r in rows] == [
        "gather_blocks",
        "scatter_blocks",
        "write_kv_slots",
        "decode",
        "prefill+decode",
    ]
    assert all(r.triton_ms > 0 and r.torch_ms > 0 for r in rows)
    assert all(r.rel_diff < 1e-5 for r in rows), rows


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_main_without_cuda_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    assert "no CUDA" in capsys.readouterr().out
