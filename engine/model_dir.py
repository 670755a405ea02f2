"""Resolve a `--model` argument: a checkpoint directory, a `.gguf` file, a registered model name
(`engine.model_registry`, e.g. `smollm2-135m-instruct`), or `tiny[:SHAPE]` for a built-in tiny model."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

DEFAULT_TINY_SHAPE = "llama-2l"
MODEL_HELP = (
    "checkpoint directory, .gguf file (converted once), registered name such as "
    "smollm2-135m-instruct (fetched once), or tiny[:SHAPE]"
)


def cache_dir() -> Path:
    return Path(os.environ.get("SPLITSERVE_CACHE", Path.home() / ".cache" / "splitserve"))


def _tiny_recipe_digest() -> str:
    """Digest of everything the tiny checkpoint is made from, so a changed recipe never reuses a stale cache."""
    import engine

    root = Path(engine.__file__).parent
    h = hashlib.sha256()
    for path in [
        root / "tiny.py",
        root / "shapes.py",
        root / "model_config.py",
        *sorted((root / "data").glob("*")),
    ]:
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def resolve_model_dir(spec: str | Path, say: Callable[[str], None] | None = None) -> Path:
    """Return a directory holding a Hugging Face checkpoint.

    `tiny` or `tiny:SHAPE` builds the deterministic tiny checkpoint once into the cache directory
    (`$SPLITSERVE_CACHE`, default `~/.cache/splitserve`) and reuses it; a registered name is fetched
    and converted once into `<cache>/models/NAME`; a `.gguf` file is converted once into
    `<cache>/models/` keyed by its digest; anything else must be an existing directory. `say` gets one
    line per slow first-use step (download, conversion).
    """
    text = str(spec)
    if text == "tiny" or text.startswith("tiny:"):
        from engine.tiny import make_tiny_model

        shape = text.partition(":")[2] or DEFAULT_TINY_SHAPE
        target = cache_dir() / f"tiny-{shape}-{_tiny_recipe_digest()}"
        if not (target / "config.json").exists():
            staging = target.with_name(f"{target.name}.tmp{os.getpid()}")
            make_tiny_model(staging, shape=shape)
            try:
                staging.rename(target)
            except OSError:  # another process built it first; theirs is byte-identical
                shutil.rmtree(staging)
        return target
    from engine.model_registry import REGISTRY, fetch

    if text in REGISTRY:
        return fetch(text, say=say)
    path = Path(text)
    if path.suffix == ".gguf":
        from engine.gguf_convert import gguf_model_dir

        return gguf_model_dir(path, say=say)
    if not path.is_dir():
        raise FileNotFoundError(
            f"model directory {path} does not exist (pass a checkpoint directory, a .gguf file, "
            f"'tiny', or one of: {', '.join(sorted(REGISTRY))})"
        )
    return path
