"""Fixtures for the kernel tests: the device, and switches that pick a kernel backend."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

from kernels import cpu_ext
from kernels.dispatch import Backend, forced

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def seeded() -> None:
    """Every kernel test draws the same inputs whichever worker runs it, after whatever tests:
    a tolerance that holds for one draw holds in CI too (an unseeded query once failed a check
    there that never failed locally)."""
    torch.manual_seed(0)


@pytest.fixture
def force_triton() -> Iterator[None]:
    """Routes the public kernel functions to Triton even for CPU tensors (interpreter)."""
    with forced("triton"):
        yield


@pytest.fixture
def force_cpp() -> Iterator[None]:
    """Routes float32 CPU kernel calls to the C++ kernels, which must build (skipped only where
    ``SPLITSERVE_CPU_KERNELS=0`` turns them off)."""
    if not cpu_ext.enabled():
        pytest.skip("SPLITSERVE_CPU_KERNELS=0")
    assert cpu_ext.load() is not None, "the C++ CPU kernels did not build; see the warning logged"
    with forced("cpp"):
        yield


@pytest.fixture
def bf16_cpp() -> ModuleType:
    """The C++ kernels where their AVX512-BF16 paths run (the GEMM, the bfloat16 attention kernels);
    skips elsewhere."""
    cpp = cpu_ext.load()
    if cpp is None or not cpp.has_bf16_dot():
        pytest.skip("needs the C++ kernels on a CPU with AVX512-BF16")
    return cpp


@pytest.fixture(params=["torch", "triton", "cpp"])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    """Runs the test once per backend, every public kernel call forced onto it."""
    if request.param == "cpp":
        request.getfixturevalue("force_cpp")
        yield "cpp"
        return
    with forced(request.param):
        yield request.param
