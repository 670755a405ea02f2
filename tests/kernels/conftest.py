"""Fixtures for the kernel tests: the device, and switches that pick a kernel backend."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kernels.dispatch import Backend, forced

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def force_triton() -> Iterator[None]:
    """Routes the public kernel functions to Triton even for CPU tensors (interpreter)."""
    with forced("triton"):
        yield


@pytest.fixture(params=["torch", "triton"])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    """Runs the test once per backend, every public kernel call forced onto it."""
    with forced(request.param):
        yield request.param
