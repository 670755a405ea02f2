"""Load a local Hugging Face checkpoint directory: config, safetensors weights, tokenizer, identity.

Nothing here touches the network: the directory must hold config.json, either `model.safetensors` or
`model.safetensors.index.json` plus its shards, and the tokenizer files AutoTokenizer reads.

The model identity is a SHA-256 hex digest over, in order, each safetensors file (sorted by name), then
tokenizer.json, tokenizer_config.json (which holds the chat template), chat_template.jinja, config.json
and generation_config.json (it adds stop ids) where present; each part is its file name, byte length
and the SHA-256 digest of its bytes. It depends only on file bytes, so every process that loads the
same directory computes the same identity. Files are digested on their own threads (hashlib runs
without the GIL): `model_identity` digests the shards in parallel, `load_model` digests a shard while
it parses the one it read.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import structlog
import torch

from engine.model_config import ModelConfig

log = structlog.get_logger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_IDENTITY_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
)
_CHUNK = 1 << 22
# tensors some checkpoints carry that no supported model has as a parameter
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass
class LoadedModel:
    """A checkpoint in memory. The caller owns the tensors; nothing here keeps a reference to them.

    `weights` uses Hugging Face parameter names (`model.layers.0.self_attn.q_proj.weight`, ...) exactly
    as `config.parameter_shapes()` lists them: `lm_head.weight` is absent when embeddings are tied.
    The tokenizer is read from `model_dir` on first use: serving workers never tokenize (the
    coordinator does), and transformers' AutoTokenizer costs a worker ~3 s of imports at start.
    """

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    identity: str
    model_dir: Path

    @cached_property
    def tokenizer(self) -> Any:
        """transformers' tokenizer for the checkpoint (a PreTrainedTokenizerFast)."""
        return load_tokenizer(self.model_dir)

    @property
    def chat_template(self) -> str | None:
        """The checkpoint's default chat template, None where it has none."""
        template = self.tokenizer.chat_template
        if isinstance(template, dict):  # named templates: the engine serves the default one
            return template.get("default")
        return template


def load_model(
    model_dir: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> LoadedModel:
    """Load config and weights (floating tensors cast to `dtype`, all moved to `device`); the
    tokenizer loads on first use (`LoadedModel.tokenizer`).

    Each safetensors file is read once; the identity is hashed from those same bytes.
    Raises FileNotFoundError for missing files and ValueError for an unsupported or inconsistent
    checkpoint (the message names the file, architecture or tensors).
    """
    from safetensors.torch import load as load_safetensors

    model_dir = _existing_dir(model_dir)
    config = load_config(model_dir)
    raw: dict[str, torch.Tensor] = {}
    digests: list[tuple[str, int, Future[bytes]]] = []
    with ThreadPoolExecutor(1, thread_name_prefix="identity") as digesting:
        for shard in shard_files(model_dir):
            if digests:
                digests[-1][2].result()  # the previous shard's bytes are let go before the next read
            data = shard.read_bytes()
            digests.append((shard.name, len(data), digesting.submit(_digest, shard.name, len(data), [data])))
            raw.update(load_safetensors(data))
            del data
        _check_names(config, raw, model_dir)
        weights = {}
        for name in list(raw):
            tensor = raw.pop(name)
            weights[name] = tensor.to(
                device=device, dtype=dtype if tensor.is_floating_point() else tensor.dtype
            )
        shards = [(name, size, digest.result()) for name, size, digest in digests]
    identity = _identity(shards, model_dir)
    log.info("model loaded", model_dir=str(model_dir), architecture=config.architecture, identity=identity)
    return LoadedModel(config, weights, identity, model_dir)


def load_config(model_dir: str | Path) -> ModelConfig:
    """Parse config.json; end-of-sequence ids from generation_config.json are added to the config's."""
    model_dir = _existing_dir(model_dir)
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir}: no config.json (not a Hugging Face checkpoint directory)")
    try:
        config = ModelConfig.from_hf_dict(json.loads(path.read_text()))
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        extra = json.loads(gen_path.read_text()).get("eos_token_id")
        extra_ids = extra if isinstance(extra, list) else [] if extra is None else [extra]
        merged = tuple(dict.fromkeys([*config.eos_token_ids, *extra_ids]))
        config = replace(config, eos_token_ids=merged)
    return config


def load_tokenizer(model_dir: str | Path) -> Any:
    """The checkpoint's tokenizer via transformers' AutoTokenizer, from local files only."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(_existing_dir(model_dir)), local_files_only=True)


def model_identity(model_dir: str | Path) -> str:
    """The identity `load_model` would report, computed by streaming the files (no tensors built);
    the shards are digested in parallel, a thread each up to the CPU count."""
    model_dir = _existing_dir(model_dir)
    paths = shard_files(model_dir)
    sizes = [path.stat().st_size for path in paths]
    with ThreadPoolExecutor(min(len(paths), os.cpu_count() or 1), thread_name_prefix="identity") as pool:
        digests = list(pool.map(_stream_digest, paths, sizes))
    return _identity([(p.name, n, d) for p, n, d in zip(paths, sizes, digests, strict=True)], model_dir)


def shard_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files, sorted by name."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (model_dir / n).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shard files that do not exist: {missing}")
        return [model_dir / n for n in names]
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE]
    raise FileNotFoundError(f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE}")


def _digest(name: str, size: int, chunks: Iterable[bytes]) -> bytes:
    """SHA-256 of a file's bytes given in `chunks`; OSError when they are not `size` bytes."""
    sha, seen = hashlib.sha256(), 0
    for chunk in chunks:
        sha.update(chunk)
        seen += len(chunk)
    if seen != size:
        raise OSError(f"{name} changed size while being hashed ({size} -> {seen} bytes)")
    return sha.digest()


def _stream_digest(path: Path, size: int) -> bytes:
    with path.open("rb") as f:
        return _digest(path.name, size, iter(lambda: f.read(_CHUNK), b""))


def _identity(shards: list[tuple[str, int, bytes]], model_dir: Path) -> str:
    """The identity from each shard's (name, size, digest) and the small files read now (module
    docstring)."""
    parts = list(shards)
    for name in _IDENTITY_FILES:
        path = model_dir / name
        if path.is_file():
            data = path.read_bytes()
            parts.append((name, len(data), _digest(name, len(data), [data])))
    sha = hashlib.sha256()
    for name, size, digest in parts:
        sha.update(f"{name}\0{size}\0".encode() + digest)
    return sha.hexdigest()


def _existing_dir(model_dir: str | Path) -> Path:
    path = Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist or is not a directory")
    return path


def _check_names(config: ModelConfig, raw: dict[str, torch.Tensor], model_dir: Path) -> None:
    """Drop tensors the model does not use; raise if any parameter is missing, unexpected or misshapen."""
    for name in [n for n in raw if n.endswith(_IGNORED_SUFFIXES)]:
        del raw[name]
    if config.tie_word_embeddings and raw.pop("lm_head.weight", None) is not None:
        log.info("dropped lm_head.weight of a tied checkpoint", model_dir=str(model_dir))
    expected = config.parameter_shapes()
    problems = []
    if missing := sorted(expected.keys() - raw.keys()):
        problems.append(f"missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if unexpected := sorted(raw.keys() - expected.keys()):
        problems.append(f"unexpected tensors {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
    wrong = [
        f"{n} {tuple(raw[n].shape)} != {s}" for n, s in expected.items() if n in raw and raw[n].shape != s
    ]
    if wrong:
        problems.append(f"shape mismatches {wrong[:5]}")
    if problems:
        raise ValueError(f"{model_dir} ({config.architecture}): " + "; ".join(problems))
