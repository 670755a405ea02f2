"""How the C++ CPU kernels are compiled: one library per instruction set, shared by `setup.py`
(install-time build) and `kernels.cpu_ext` (the run-time fallback build). Standard library only, so
that `setup.py` can read it before the package's dependencies exist."""

from __future__ import annotations

import hashlib
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
SOURCES = [
    "cpu_kernels.cpp",
    "cpu_gemm.cpp",
    "cpu_prefill_attention.cpp",
    "cpu_threads.cpp",
]  # relative to CSRC
HEADERS = ["lanes.h"]  # included by the sources: in the digest, never compiled alone
# torch.backends.cpu.get_cpu_capability() names ("AVX512", "AVX2", "DEFAULT") -> compiler flags
ISA_FLAGS: dict[str, list[str]] = {
    "AVX512": ["-mavx512f", "-mavx512vl", "-mavx2", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
    "DEFAULT": [],
}
# -Wno-psabi: every vector-typed function is internal and inlined, so the ABI note GCC gives for
# vector returns wider than the build's ISA (the AVX512-BF16 kernel's, in the AVX2 build) is moot
CFLAGS = ["-O3", "-fopenmp", "-Wno-psabi"]
LDFLAGS = ["-fopenmp"]


def source_digest() -> str:
    """The digest compiled into each library (``module.source_digest``): ``d`` + SHA-256 of the sources
    and the headers they include."""
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update(name.encode() + b"\0" + (CSRC / name).read_bytes())
    return "d" + h.hexdigest()


def compile_flags(isa: str) -> list[str]:
    """Every compiler flag of ``isa``'s library, the source digest define included."""
    return [*CFLAGS, *ISA_FLAGS[isa], f"-DSPLITSERVE_SOURCE_DIGEST={source_digest()}"]


def isa_of(capability: str) -> str:
    """The library variant for a CPU capability torch reports (anything unknown gets the baseline)."""
    if capability.startswith("AVX512"):
        return "AVX512"
    return capability if capability in ISA_FLAGS else "DEFAULT"


def module_name(isa: str) -> str:
    """The extension's module name inside `kernels` (also its TORCH_EXTENSION_NAME)."""
    return f"_cpu_kernels_{isa.lower()}"
