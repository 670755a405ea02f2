"""What this CPU offers the kernels, read from Linux's ``/proc/cpuinfo`` (nothing elsewhere).

The one decision it drives: on a CPU with AMX bfloat16 tiles, multi-row bfloat16 work (prompt GEMMs,
prompt attention) runs on oneDNN and torch's CPU flash attention, which use the tiles, instead of
this project's AVX512-BF16 kernels. Measured on a 2-core Xeon with AMX (session 33, one core,
SmolLM2-135M's shape, `python -m kernels.gemm_bench`): the 120 GEMMs of a step took 30 against 151 ms
at 64 rows and 181 against 2,117 at 1,024, while ours stayed 1.19x faster at one row only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True, slots=True)
class CpuInfo:
    """The first processor's model name ("" where unknown) and its feature flags."""

    model: str
    flags: frozenset[str]


def read_cpuinfo(path: Path = CPUINFO) -> CpuInfo:
    """`path` parsed; an empty record where it cannot be read (not Linux)."""
    model, flags = "", frozenset[str]()
    try:
        text = path.read_text()
    except OSError:
        return CpuInfo(model, flags)
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and not model:
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = frozenset(value.split())
    return CpuInfo(model, flags)


@functools.cache
def has_amx_bf16() -> bool:
    """Whether this CPU has AMX bfloat16 tiles that the kernel lets processes use (Linux lists
    ``amx_bf16`` only then); read once per process."""
    return "amx_bf16" in read_cpuinfo().flags
