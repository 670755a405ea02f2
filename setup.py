"""Builds the C++ CPU kernels (kernels/csrc) when the package is built or installed.

One extension per instruction set (`kernels._cpu_kernels_{avx512,avx2,default}`, see
kernels/cpu_build.py); `kernels.cpu_ext` loads the one matching the CPU at run time, so a wheel or an
image built on one machine serves any x86-64 machine. torch must already be installed when this runs
(the build links against it): `make setup` installs torch first and then this package with
`--no-build-isolation`; the Dockerfile does the same. Each variant takes ~45 s of CPU:
SPLITSERVE_CPU_KERNEL_ISAS=host (what `make setup` sets) builds only this machine's variant, a comma
list (AVX512,AVX2,DEFAULT) picks variants, SPLITSERVE_BUILD_CPU_KERNELS=0 skips the build (the
kernels then compile on first use, or the torch references run).

Always, with or without torch: `kvtransfer._rma_wake`, the plain C library of the RMA gets'
completion callback (kvtransfer/csrc/rma_wake.c, loaded with ctypes by kvtransfer.rma_wake; no
Python module inside).
"""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
from pathlib import Path

from setuptools import Extension, setup

_spec = importlib.util.spec_from_file_location(
    "cpu_build", Path(__file__).parent / "kernels" / "cpu_build.py"
)
assert _spec is not None and _spec.loader is not None
cpu_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cpu_build)


def _extensions() -> tuple[list[object], dict[str, object]]:
    if os.environ.get("SPLITSERVE_BUILD_CPU_KERNELS", "1") == "0":
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:  # an isolated build: torch must never be pulled into it (a CUDA wheel)
        print(
            "setup.py: torch is not importable, so the C++ CPU kernels are NOT prebuilt (they compile "
            "on first use); install torch first and use pip install --no-build-isolation",
            file=sys.stderr,
        )
        return [], {}

    wanted = os.environ.get("SPLITSERVE_CPU_KERNEL_ISAS", "")
    if wanted == "host":
        isas = [cpu_build.isa_of(torch.backends.cpu.get_cpu_capability())]
    elif wanted:
        isas = [isa.strip().upper() for isa in wanted.split(",")]
        unknown = set(isas) - set(cpu_build.ISA_FLAGS)
        if unknown:
            raise SystemExit(
                f"SPLITSERVE_CPU_KERNEL_ISAS: unknown {sorted(unknown)}; use {list(cpu_build.ISA_FLAGS)}"
            )
    else:
        isas = list(cpu_build.ISA_FLAGS) if platform.machine() in ("x86_64", "AMD64") else ["DEFAULT"]
    exts = [
        CppExtension(
            name=f"kernels.{cpu_build.module_name(isa)}",
            sources=[f"kernels/csrc/{s}" for s in cpu_build.SOURCES],
            extra_compile_args=cpu_build.compile_flags(isa),
            extra_link_args=cpu_build.LDFLAGS,
        )
        for isa in isas
    ]
    return exts, {"build_ext": BuildExtension}


RMA_WAKE = Extension(
    "kvtransfer._rma_wake", sources=["kvtransfer/csrc/rma_wake.c"], extra_compile_args=["-O2"]
)

_ext_modules, _cmdclass = _extensions()
setup(ext_modules=[RMA_WAKE, *_ext_modules], cmdclass=_cmdclass)
