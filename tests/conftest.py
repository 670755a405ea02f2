"""Suite-wide test set-up."""

from __future__ import annotations

import os

import torch

# Triton decorates kernels at import; without CUDA its kernels can only run in the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
