"""The C++ CPU kernels in ``kernels/csrc/``, built when the package is installed and loaded prebuilt.

``setup.py`` compiles one library per instruction set (``kernels._cpu_kernels_avx512|avx2|default``,
flags in ``kernels.cpu_build``); ``load()`` imports the one matching the CPU capability torch reports
(well under a second). Only where that library is missing (a checkout used without ``make setup``, or
a build with ``SPLITSERVE_BUILD_CPU_KERNELS=0``) does it fall back to compiling the same source with
torch's extension builder into torch's extension cache (about 25 s with g++ on 2 cores; ninja and a
C++ compiler are needed), logging that it does. Where that fails too, or ``SPLITSERVE_CPU_KERNELS=0``
is set, ``load()`` returns ``None`` after one warning and every caller runs the torch reference.

Kernels here (float32 and bfloat16), each the CPU twin of a Triton kernel or a torch reference with
its semantics: ``paged_decode_attention`` (bfloat16 on AVX512-BF16 CPUs by its own kernel, reported by
``has_bf16_dot()``), ``write_kv_slots``, the elementwise steps of ``kernels.fused`` and, on
AVX512-BF16 CPUs, the bfloat16 GEMM of ``kernels.gemm``; beside them ``place_team``, which sizes the
calling thread's OpenMP team and binds each of its threads to CPUs (engine/worker/core_lease.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib
import os
import shutil
import time
from pathlib import Path
from types import ModuleType

import structlog
import torch

from kernels import cpu_build

log = structlog.get_logger(__name__)


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
    isa = cpu_build.isa_of(torch.backends.cpu.get_cpu_capability())
    start = time.perf_counter()
    module = _prebuilt(isa)
    source = "prebuilt"
    if module is None:
        try:
            module = _build(isa)
        except Exception as exc:
            log.warning("cpu kernels unavailable; using torch references", error=str(exc)[:500])
            return None
        source = "built"
    log.info(
        "cpu kernels loaded",
        isa=isa,
        bf16_dot=module.has_bf16_dot(),
        source=source,
        seconds=round(time.perf_counter() - start, 2),
    )
    return module


def _prebuilt(isa: str) -> ModuleType | None:
    """The library ``setup.py`` built for ``isa`` when it exists and was built from today's sources."""
    try:
        module = importlib.import_module(f"kernels.{cpu_build.module_name(isa)}")
    except ImportError as exc:
        log.info("no prebuilt cpu kernels; compiling them now (once per machine)", isa=isa, error=str(exc))
        return None
    if getattr(module, "source_digest", None) != cpu_build.source_digest():
        log.warning(
            "prebuilt cpu kernels are older than kernels/csrc; compiling them now. Rebuild with: "
            "SPLITSERVE_CPU_KERNEL_ISAS=host python setup.py build_ext --inplace",
            library=module.__file__,
        )
        return None
    return module


def _build(isa: str) -> ModuleType:
    """Compile ``isa``'s library with torch's JIT extension builder, in a build directory of its own
    (one per source digest, under torch's extension root) that only one process builds in at a time.

    torch's builder serializes with a ``lock`` file that a build killed midway leaves behind, after
    which every later start waits on it forever. So builders here first take an ``flock`` on the
    directory (released by the kernel when its holder dies) and, holding it, delete any ``lock`` file:
    no other builder can be running, so the file is stale."""
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    name = f"splitserve{cpu_build.module_name(isa)}"
    build_dir = Path(cpp_extension.get_default_build_root()) / f"{name}-{cpu_build.source_digest()[:13]}"
    build_dir.mkdir(parents=True, exist_ok=True)
    with (build_dir / ".splitserve-build").open("a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # wait (bounded by another build's length): one builder
        (build_dir / "lock").unlink(missing_ok=True)
        return cpp_extension.load(
            name=name,
            sources=[str(cpu_build.CSRC / s) for s in cpu_build.SOURCES],
            extra_cflags=cpu_build.compile_flags(isa),
            extra_ldflags=cpu_build.LDFLAGS,
            build_directory=str(build_dir),
            verbose=False,
        )
