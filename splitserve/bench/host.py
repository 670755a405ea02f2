"""The machine a study ran on, recorded in its JSON (`workload.host`): studies compare only within one
sitting, and the CPU (its matrix extensions above all: bf16 prefill on a core with AMX is several
times that on one without) is what differs between two sittings' boxes."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

from kernels.cpu_features import CPUINFO, read_cpuinfo

# the ISA extensions that move this project's CPU numbers (docs/performance.md, session 14)
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def host_info(cpuinfo: Path = CPUINFO) -> dict[str, Any]:
    """CPU model, CPU count, the ISA_FLAGS it has, and the kernel release (model "" where unknown)."""
    cpu = read_cpuinfo(cpuinfo)
    return {
        "cpu": cpu.model or platform.processor(),
        "cpus": os.cpu_count(),
        "isa": [f for f in ISA_FLAGS if f in cpu.flags],
        "kernel": platform.release(),
    }
