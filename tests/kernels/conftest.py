"""Fixtures for the kernel tests: a device and a switch that sends CPU tensors to Triton."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kernels.dispatch import forced

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def force_triton() -> Iterator[None]:
    """Routes the public kernel functions to Triton even for CPU tensors (interpreter)."""
    with forced("triton"):
        yield
