"""GGUF files as Hugging Face checkpoints: dequantized once with transformers' GGUF loader, then cached.

`--model` may name a `.gguf` file (what llama.cpp users hold). `gguf_model_dir(path)` converts it into
`<cache>/models/gguf-<stem>-<digest>-<dtype>/` (config.json, generation_config.json,
model.safetensors, tokenizer.json, tokenizer_config.json, chat_template.jinja) keyed by the file's
SHA-256, so a changed file never reuses a stale conversion and every process that resolves the same
file gets the same directory (and so the same model identity). The conversion reads the GGUF through
transformers (`from_pretrained(..., gguf_file=...)`, backed by the `gguf` package), which supports the
Llama, Mistral, Qwen2 and Qwen3 families among others.

The conversion writes into a private staging directory and renames it into place, so concurrent
processes never see a half-written checkpoint; the loser of the rename deletes its copy.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

DTYPES = ("float32", "bfloat16")
_CHUNK = 1 << 22


def file_digest(path: Path) -> str:
    """SHA-256 hex digest of a file, streamed."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def models_cache() -> Path:
    from engine.model_dir import cache_dir

    return cache_dir() / "models"


def gguf_model_dir(path: Path, dtype: str = "float32", say: Callable[[str], None] | None = None) -> Path:
    """The cached checkpoint directory converted from the GGUF file `path` (converted on first use,
    announced to `say`)."""
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    target = models_cache() / f"gguf-{path.stem}-{file_digest(path)[:16]}-{dtype}"
    if not (target / "config.json").is_file():
        if say:
            say(f"converting {path.name} into a {dtype} Hugging Face checkpoint (first use only)")
        convert_gguf(path, target, dtype)
    return target


def convert_gguf(gguf: Path, target: Path, dtype: str = "float32") -> Path:
    """Dequantize `gguf` into a Hugging Face checkpoint at `target` (weights stored as `dtype`).

    Raises ValueError for an unsupported dtype or a GGUF transformers cannot read (the message names
    the file). Returns `target`; an existing `target` (another process won the race) is kept.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f"{target.name}.tmp{os.getpid()}")
    log.info("converting gguf", gguf=str(gguf), target=str(target), dtype=dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype)
        )
    except (ValueError, KeyError, OSError) as exc:
        raise ValueError(f"{gguf}: transformers cannot convert this GGUF file: {exc}") from exc
    # transformers marks a GGUF-loaded model as quantized although its tensors are already dequantized,
    # and refuses to save a quantized model: drop the marker, the weights are plain tensors.
    model.hf_quantizer = None  # type: ignore[assignment]  # nn.Module attribute typing
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.rename(target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
        log.info("gguf converted by another process", target=str(target))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
