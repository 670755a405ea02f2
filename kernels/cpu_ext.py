"""The C++ CPU kernels in ``kernels/csrc/``, compiled on first use by torch's extension builder.

``load()`` builds once per machine into torch's extension cache (about 25 s with g++ on 2 cores;
ninja and a C++ compiler are needed), then loads the cached library in well under a second. The
build targets the CPU capability torch reports (AVX512, AVX2 or baseline), which is part of the
library's name, so a cache shared by different machines never hands one the other's instructions.
Where the build fails, or ``SPLITSERVE_CPU_KERNELS=0`` is set, ``load()`` returns ``None`` after one
warning and every caller runs the torch reference instead.

Kernels here (float32 only), each the CPU twin of a Triton kernel with its torch reference's
semantics: ``paged_decode_attention`` and ``write_kv_slots``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import time
from pathlib import Path
from types import ModuleType

import structlog
import torch

log = structlog.get_logger(__name__)

SOURCES = [Path(__file__).parent / "csrc" / "cpu_kernels.cpp"]
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512vl", "-mavx2", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}


def enabled() -> bool:
    return os.environ.get("SPLITSERVE_CPU_KERNELS", "1") != "0"


def _put_ninja_on_path() -> None:
    """torch's builder runs ``ninja`` from PATH; the pip package's binary is not there unless the
    virtual environment is activated."""
    if shutil.which("ninja") is None:
        with contextlib.suppress(ImportError):
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


@functools.cache
def load() -> ModuleType | None:
    """The compiled module, or ``None`` when disabled or unbuildable (logged once)."""
    if not enabled():
        return None
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    capability = torch.backends.cpu.get_cpu_capability()
    isa = "AVX512" if capability.startswith("AVX512") else capability
    start = time.perf_counter()
    try:
        module = cpp_extension.load(
            name=f"splitserve_cpu_kernels_{isa.lower()}",
            sources=[str(p) for p in SOURCES],
            extra_cflags=["-O3", "-fopenmp", *_ISA_FLAGS.get(isa, [])],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:
        log.warning("cpu kernels unavailable; using torch references", error=str(exc)[:500])
        return None
    log.info("cpu kernels loaded", isa=isa, seconds=round(time.perf_counter() - start, 2))
    return module
