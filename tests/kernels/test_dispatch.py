"""Backend choice: CUDA tensors to Triton, CPU tensors to torch, unless forced."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kernels import dispatch
from kernels.dispatch import forced, next_pow2, use_triton


def test_cpu_tensors_use_torch_unless_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch, "FORCED", None)  # as if SPLITSERVE_FORCE_TRITON were unset
    cpu = torch.zeros(1)
    assert not use_triton(cpu)
    with forced("triton"):
        assert use_triton(cpu)
        with forced("torch"):
            assert not use_triton(cpu)
        assert use_triton(cpu)
    assert not use_triton(cpu)


def test_next_pow2() -> None:
    assert [next_pow2(n) for n in (1, 2, 3, 5, 16, 80, 128)] == [1, 2, 4, 8, 16, 128, 128]


def test_importing_kernels_does_not_import_triton() -> None:
    code = "import sys, kernels; sys.exit('triton' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
