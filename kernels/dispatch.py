"""Chooses between a Triton kernel, a C++ CPU kernel and the torch reference.

CUDA tensors go to Triton; float32 CPU tensors (and bfloat16 ones, for decode attention) go to the
C++ kernel where one exists and ``kernels.cpu_ext`` could build it; everything else to the torch
reference. ``forced``
overrides that for tests and benchmarks: ``forced("triton")`` sends CPU tensors
to Triton (which then needs ``TRITON_INTERPRET=1``), ``forced("torch")`` runs the
reference everywhere, ``forced("cpp")`` the C++ kernels on the CPU tensors they take and the
reference for the rest. ``SPLITSERVE_FORCE_TRITON=1`` in the environment (read at
import) starts the process forced to Triton.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Literal

import torch

from kernels import cpu_ext

Backend = Literal["torch", "triton", "cpp"]

FORCED: Backend | None = "triton" if os.environ.get("SPLITSERVE_FORCE_TRITON", "") == "1" else None


def use_triton(t: torch.Tensor) -> bool:
    """True when the operation on ``t`` should run the Triton kernel."""
    return FORCED == "triton" if FORCED is not None else t.is_cuda


@contextmanager
def forced(backend: Backend) -> Iterator[None]:
    """Runs the block with every kernel call on ``backend`` (process-wide, not thread-safe)."""
    global FORCED
    previous, FORCED = FORCED, backend
    try:
        yield
    finally:
        FORCED = previous


# every C++ CPU kernel takes float32 and bfloat16 (float32 math; bfloat16 rounded where torch's ops round)
CPU_KERNEL_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)


def cpu_kernels(t: torch.Tensor, dtypes: tuple[torch.dtype, ...] = CPU_KERNEL_DTYPES) -> ModuleType | None:
    """The C++ CPU kernels (``kernels.cpu_ext``) when the operation on ``t`` should run them: a CPU
    tensor of one of ``dtypes`` (the kernel's), nothing forcing another backend."""
    if FORCED not in (None, "cpp") or t.device.type != "cpu" or t.dtype not in dtypes:
        return None
    return cpu_ext.load()


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1); Triton tile sizes must be powers of two."""
    return 1 << (max(n, 1) - 1).bit_length()
