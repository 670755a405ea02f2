"""`splitserve make-tiny-model DIR [--shape NAME] [--seed N]`: a deterministic tiny checkpoint.

Writes a complete Hugging Face checkpoint directory (config.json, generation_config.json,
model.safetensors, tokenizer.json, tokenizer_config.json with a ChatML-style chat template) for a shape
from `engine.shapes.SHAPES`. The same shape and seed give the same bytes in every file.

The tokenizer is a byte-level BPE trained with `tokenizers` on the text in engine/data/. Parameter names
and shapes come from instantiating the transformers model class on the meta device; each tensor is drawn
from its own generator, seeded from (seed, name). The scales are chosen so that greedy decoding is
decisive: the final logits have a standard deviation of about `LOGIT_STD`, far above float32 noise,
and attention and MLP outputs are as large as the residual stream, so the next token depends on the
context rather than on the last token alone.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from engine.shapes import BOS_ID, DEFAULT_SHAPE, EOS_ID, PAD_ID, SHAPES, SPECIAL_TOKENS, TINY_VOCAB_SIZE

if TYPE_CHECKING:
    import torch

    from engine.model_config import ModelConfig

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LOGIT_STD = 4.0  # target std of the final logits (see module docstring)
QK_GAIN = 1.5  # q and k elements have std ~QK_GAIN, so attention scores have std ~QK_GAIN**2
# o_proj and down_proj write the residual stream at this gain: the layers outweigh the embedding, so a tied
# model does not just predict its last input token again
RESIDUAL_GAIN = 2.0
NORM_JITTER = 0.1  # norm weights are 1 + NORM_JITTER * N(0, 1): a model that ignores them is caught
BIAS_STD = 0.2


def make_tiny_model(out_dir: str | Path, shape: str = DEFAULT_SHAPE, seed: int = 0) -> Path:
    """Write the checkpoint for `shape` into `out_dir` (created if needed) and return its path.

    The five files are overwritten; anything else already in `out_dir` is left alone (and would count
    toward the model identity if it is a file the loader hashes), so pass a fresh directory.
    """
    import torch
    from safetensors.torch import save
    from transformers import AutoConfig, AutoModelForCausalLM

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from {sorted(SHAPES)}")
    config = SHAPES[shape]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", config.to_hf_dict())
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out, local_files_only=True))
    shapes = {name: tuple(t.shape) for name, t in meta.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    tensors = {name: _init_tensor(config, name, shape_, seed) for name, shape_ in sorted(shapes.items())}
    # bytes written here (not save_file) so the file gets the usual umask mode like the others
    (out / "model.safetensors").write_bytes(save(tensors, metadata={"format": "pt"}))
    (out / "tokenizer.json").write_text(tokenizer_json())
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": SPECIAL_TOKENS[BOS_ID],
            "eos_token": SPECIAL_TOKENS[EOS_ID],
            "pad_token": SPECIAL_TOKENS[PAD_ID],
            "chat_template": CHAT_TEMPLATE,
            "model_max_length": config.max_position_embeddings,
            "clean_up_tokenization_spaces": False,
        },
    )
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": config.bos_token_id,
            "eos_token_id": list(config.eos_token_ids),
            "pad_token_id": PAD_ID,
            "do_sample": False,
        },
    )
    return out


@functools.cache
def tokenizer_json() -> str:
    """The serialized byte-level BPE tokenizer trained on engine/data/*.txt (same text, same bytes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    data = resources.files("engine").joinpath("data")
    texts = [f.read_text(encoding="utf-8") for f in sorted(data.iterdir(), key=lambda f: f.name)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    if tokenizer.get_vocab_size() != TINY_VOCAB_SIZE:
        raise RuntimeError(f"trained {tokenizer.get_vocab_size()} tokens, the shapes need {TINY_VOCAB_SIZE}")
    bos = SPECIAL_TOKENS[BOS_ID]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, BOS_ID)]
    )
    return str(tokenizer.to_str(pretty=True))


def _init_tensor(config: ModelConfig, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Draw one parameter: `mean + std * N(0, 1)` from a generator seeded by (seed, name)."""
    import torch

    generator = torch.Generator().manual_seed(
        int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1
    )
    mean, std = _init_scale(config, name, shape)
    return (mean + std * torch.randn(shape, generator=generator, dtype=torch.float32)).contiguous()


def _init_scale(config: ModelConfig, name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    """(mean, std) for a parameter, by its role; `shape[-1]` is a weight's fan-in."""
    if name.endswith("norm.weight"):
        return 1.0, NORM_JITTER
    if name.endswith(".bias"):
        return 0.0, BIAS_STD
    fan_in_std = 1.0 / math.sqrt(shape[-1])
    if name == "lm_head.weight" or (name == "model.embed_tokens.weight" and config.tie_word_embeddings):
        return 0.0, LOGIT_STD * fan_in_std
    if name == "model.embed_tokens.weight":
        return 0.0, 1.0
    if name.endswith(("q_proj.weight", "k_proj.weight")):
        return 0.0, QK_GAIN * fan_in_std
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return 0.0, RESIDUAL_GAIN * fan_in_std
    return 0.0, fan_in_std


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, help="output directory (created if missing)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=DEFAULT_SHAPE, help="named model shape")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (same seed, same bytes)")


def run(args: argparse.Namespace) -> int:
    out = make_tiny_model(args.dir, shape=args.shape, seed=args.seed)
    print(f"wrote {args.shape} (seed {args.seed}) to {out}")
    return 0
