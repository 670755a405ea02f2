"""The C++ CPU kernels come prebuilt from the install (setup.py), not compiled at serve time."""

from __future__ import annotations

import fcntl
import re
import shutil
import subprocess
from pathlib import Path

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


def prefetching_walks(library: str) -> dict[str, bool]:
    """Each decode attention kernel's block walk (its body, `{lambda(BlockWalk<...> const&)}`) in the
    library at `library`, and whether its machine code holds a prefetch instruction."""
    listing = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", "-C", library], capture_output=True, text=True, check=True
    ).stdout
    walks: dict[str, bool] = {}
    name = ""
    for line in listing.splitlines():
        if header := re.match(r"^[0-9a-f]+ <(.*)>:$", line):
            name = header.group(1)
            walk = "{lambda((anonymous namespace)::BlockWalk<" in name and "[clone" not in name  # not .cold
            if name.startswith("decode_attention") and walk:
                walks[name] = False
        elif name in walks and "prefetch" in line:
            walks[name] = True
    return walks


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs binutils' objdump")
def test_every_decode_kernel_walk_prefetches_its_next_blocks() -> None:
    """GCC counts a prefetch as no side effect: a function that only prefetches is "pure", and a call
    to it whose result goes unused is deleted. BlockWalk::ahead's was, until session 32, and the decode
    kernels then read every K/V block past the first two cold (attention 1.5-2.3x slower in a step).
    The generic kernel's float32 walk is inlined into its thread split and has no name of its own."""
    module = cpu_ext.load()
    assert module is not None and module.__file__ is not None
    walks = prefetching_walks(module.__file__)
    assert len(walks) >= 13, sorted(walks)  # the generic kernel in bfloat16, 12 bfloat16-dot instances
    assert all(walks.values()), [name[:80] for name, prefetches in walks.items() if not prefetches]


def test_a_library_built_from_other_sources_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    isa = cpu_build.isa_of(torch.backends.cpu.get_cpu_capability())
    assert cpu_ext._prebuilt(isa) is not None
    monkeypatch.setattr(cpu_build, "source_digest", lambda: "d" + "0" * 64)
    assert cpu_ext._prebuilt(isa) is None


def test_a_build_killed_midway_does_not_hang_the_next_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """torch's builder waits forever on a `lock` file a killed build left; ours removes it, holding an
    flock that only a live builder can hold (torch's loader is replaced: this checks our guard only)."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    isa = cpu_build.isa_of(torch.backends.cpu.get_cpu_capability())
    seen: dict[str, object] = {}

    def load(**kwargs: object) -> object:
        build_dir = Path(str(kwargs["build_directory"]))
        seen["stale_lock_left"] = (build_dir / "lock").exists()
        with (build_dir / ".splitserve-build").open("a") as other:  # a second builder must wait
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
                seen["guarded"] = False
            except BlockingIOError:
                seen["guarded"] = True
        return "module"

    monkeypatch.setattr(cpp_extension, "load", load)
    build_dir = tmp_path / f"splitserve{cpu_build.module_name(isa)}-{cpu_build.source_digest()[:13]}"
    build_dir.mkdir()
    (build_dir / "lock").touch()  # what a build killed midway leaves
    assert cpu_ext._build(isa) == "module"
    assert seen == {"stale_lock_left": False, "guarded": True}
