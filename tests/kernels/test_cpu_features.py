"""`kernels.cpu_features`: what the kernels learn of the CPU."""

from __future__ import annotations

from pathlib import Path

from kernels import cpu_features


def test_cpu_features_read_the_flags_of_the_first_processor(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nmodel name\t: Example CPU 9000\nflags\t\t: fpu avx512f amx_bf16\n\n"
        "processor\t: 1\nmodel name\t: Other\nflags\t\t: fpu\n"
    )
    assert cpu_features.read_cpuinfo(cpuinfo) == cpu_features.CpuInfo(
        "Example CPU 9000", frozenset({"fpu", "avx512f", "amx_bf16"})
    )
    assert cpu_features.read_cpuinfo(tmp_path / "missing") == cpu_features.CpuInfo("", frozenset())
