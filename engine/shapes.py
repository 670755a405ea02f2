"""The table of named tiny model shapes used by tests, the demo and benchmarks.

Every shape shares the tokenizer `engine.tiny` trains (its size is `TINY_VOCAB_SIZE`, its special tokens
`SPECIAL_TOKENS` in id order), so a shape's checkpoint is `make_tiny_model(dir, shape)` away.
"""

from __future__ import annotations

from typing import Any

from engine.model_config import ARCHITECTURES, ModelConfig

# id order is part of the contract: bos=0, eos=1, pad=2, then the chat markers
SPECIAL_TOKENS = ("<|bos|>", "<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>")
BOS_ID, EOS_ID, PAD_ID, IM_START_ID, IM_END_ID = range(len(SPECIAL_TOKENS))
TINY_VOCAB_SIZE = 1024
DEFAULT_SHAPE = "llama-2l"


def _shape(model_type: str, **fields: Any) -> ModelConfig:
    """A ModelConfig with the tiny-family defaults, overridden by `fields`."""
    base: dict[str, Any] = {
        "architecture": ARCHITECTURES[model_type],
        "model_type": model_type,
        "vocab_size": TINY_VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "attention_bias": model_type == "qwen2",
        "qk_norm": model_type == "qwen3",
        "hidden_act": "silu",
        "bos_token_id": BOS_ID,
        "eos_token_ids": (EOS_ID, IM_END_ID),
        "torch_dtype": "float32",
        "sliding_window": None,
    }
    return ModelConfig(**(base | fields))


SHAPES: dict[str, ModelConfig] = {
    # Llama with GQA (2 query heads per kv head): the demo's default
    "llama-2l": _shape("llama"),
    # Qwen2: q/k/v bias, tied embeddings, one kv head (MQA)
    "qwen2-2l": _shape("qwen2", num_key_value_heads=1, tie_word_embeddings=True, rope_theta=1e6),
    # Qwen3: q/k norm, head_dim 32 != hidden/heads, YaRN rope scaling (attention factor != 1)
    "qwen3-2l": _shape(
        "qwen3",
        head_dim=32,
        rope_theta=1e6,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
    ),
    # Mistral: 4 query heads per kv head, small head_dim
    "mistral-2l": _shape("mistral", num_attention_heads=8, head_dim=8, rope_theta=1e6),
    # benchmark shape: Llama-3.1-style (llama3 rope), 8 heads of 64, GQA 4:1
    "llama-6l-512": _shape(
        "llama",
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=6,
        num_attention_heads=8,
        head_dim=64,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
    ),
    # the real model's shape (SmolLM2-135M, what `make setup` caches) on the tiny vocab: its KV is
    # the real one (30 layers x 3 kv heads x 64, float32: 46 KiB a token), for kvbench --model-shape
    "smollm2-135m": _shape(
        "llama",
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
}
