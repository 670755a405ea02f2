"""The one model a coordinator serves: name, identity, limits and tokenizer, never the weights."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitserve.v1 import serving_pb2


@dataclass(frozen=True, slots=True)
class ServedModel:
    """Loaded once at start by `load_served_model`; read-only afterwards.

    `identity` is the digest workers must report in Register; `context_length` bounds prompt +
    max_tokens; `vocab_size` bounds every token id a client may send.
    """

    name: str
    identity: str
    context_length: int
    vocab_size: int
    architecture: str
    dtype: str
    tokenizer: Any  # transformers PreTrainedTokenizerFast
    model_dir: Path

    def to_proto(self, prefill_workers: int = 0, decode_workers: int = 0) -> serving_pb2.Model:
        return serving_pb2.Model(
            name=self.name,
            context_length=self.context_length,
            identity=self.identity,
            architecture=self.architecture,
            vocab_size=self.vocab_size,
            dtype=self.dtype,
            prefill_workers=prefill_workers,
            decode_workers=decode_workers,
        )


def default_served_name(spec: str) -> str:
    """`tiny` and `tiny:SHAPE` serve as "tiny"; a directory serves under its own name."""
    if spec == "tiny" or spec.startswith("tiny:"):
        return "tiny"
    return Path(spec).resolve().name


def load_served_model(spec: str, name: str | None = None) -> ServedModel:
    """Resolve `--model` (a checkpoint directory or `tiny[:SHAPE]`) and load what the coordinator needs."""
    from engine.loader import load_config, load_tokenizer, model_identity
    from engine.model_dir import resolve_model_dir

    model_dir = resolve_model_dir(spec)
    config = load_config(model_dir)
    return ServedModel(
        name=name or default_served_name(spec),
        identity=model_identity(model_dir),
        context_length=config.max_position_embeddings,
        vocab_size=config.vocab_size,
        architecture=config.architecture,
        dtype=config.torch_dtype,
        tokenizer=load_tokenizer(model_dir),
        model_dir=model_dir,
    )
