"""The C++ CPU kernels come prebuilt from the install (setup.py), not compiled at serve time."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_build, cpu_ext

pytestmark = pytest.mark.skipif(not cpu_ext.enabled(), reason="SPLITSERVE_CPU_KERNELS=0")


def test_load_returns_the_prebuilt_library_of_todays_sources() -> None:
    module = cpu_ext.load()
    assert module is not None
    assert module.__name__.startswith("kernels._cpu_kernels_"), (
        f"{module.__name__} was compiled at run time: build the kernels with `make setup` or "
        "`SPLITSERVE_CPU_KERNEL_ISAS=host python setup.py build_ext --inplace`"
    )
    assert module.source_digest == cpu_build.source_digest()


def test_a_library_built_from_other_sources_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    isa = cpu_build.isa_of(torch.backends.cpu.get_cpu_capability())
    assert cpu_ext._prebuilt(isa) is not None
    monkeypatch.setattr(cpu_build, "source_digest", lambda: "d" + "0" * 64)
    assert cpu_ext._prebuilt(isa) is None
