"""Suite-wide test set-up."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

# Triton decorates kernels at import; without CUDA its kernels can only run in the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Factory `tiny_model(shape="llama-2l") -> Path`: each shape's checkpoint, built once per session.

    The directories are shared by every test of the session: treat them as read-only (copy one to
    `tmp_path` before changing it).
    """
    from engine.shapes import DEFAULT_SHAPE
    from engine.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    built: dict[str, Path] = {}

    def tiny_model(shape: str = DEFAULT_SHAPE) -> Path:
        if shape not in built:
            built[shape] = make_tiny_model(root / shape, shape)
        return built[shape]

    return tiny_model
