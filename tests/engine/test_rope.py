"""engine.rope against transformers' own rotary-embedding modules, for every rope type we accept."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoConfig, LlamaConfig, Qwen3Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from engine.model_config import ModelConfig
from engine.rope import rope_inv_freq
from engine.shapes import SHAPES

LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
ROPE_SCALINGS: dict[str, dict[str, Any] | None] = {
    "default": None,
    "linear (4.x 'type' key)": {"type": "linear", "factor": 4.0},
    "dynamic": {"type": "dynamic", "factor": 2.0},
    "llama3": LLAMA3,
    "yarn": YARN,
    "yarn mscale": YARN | {"mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16},
    "yarn attention_factor, no truncate": YARN | {"attention_factor": 1.3, "truncate": False},
}


def hf_rotary(config: ModelConfig) -> LlamaRotaryEmbedding | Qwen3RotaryEmbedding:
    if config.model_type == "qwen3":
        return Qwen3RotaryEmbedding(Qwen3Config(**config.to_hf_dict()))
    return LlamaRotaryEmbedding(LlamaConfig(**config.to_hf_dict()))


def assert_matches_transformers(config: ModelConfig) -> None:
    ours, scaling = rope_inv_freq(config)
    theirs = hf_rotary(config)
    assert ours.dtype == torch.float32 and ours.shape == (config.head_dim // 2,)
    torch.testing.assert_close(ours, theirs.inv_freq, rtol=1e-6, atol=0)
    assert scaling == pytest.approx(theirs.attention_scaling, rel=1e-9)


@pytest.mark.parametrize("scaling", ROPE_SCALINGS.values(), ids=ROPE_SCALINGS.keys())
def test_rope_matches_transformers(scaling: dict[str, Any] | None) -> None:
    config = ModelConfig.from_hf_dict(LLAMA | {"rope_scaling": scaling})
    assert_matches_transformers(config)
    if scaling is not None and "yarn" in str(scaling):
        assert rope_inv_freq(config)[1] != 1.0  # the attention factor is really exercised


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_tiny_shape_rope_matches_transformers(shape: str) -> None:
    assert_matches_transformers(SHAPES[shape])


def test_scaled_rope_differs_from_plain() -> None:
    plain, _ = rope_inv_freq(ModelConfig.from_hf_dict(LLAMA))
    for scaling in (LLAMA3, YARN, {"type": "linear", "factor": 4.0}):
        scaled, _ = rope_inv_freq(ModelConfig.from_hf_dict(LLAMA | {"rope_scaling": scaling}))
        assert not torch.equal(plain, scaled), scaling
        assert torch.equal(plain[0], scaled[0]) or scaling.get("type") == "linear"  # highest freq kept


def test_old_and_new_spelling_parse_to_the_same_config() -> None:
    old = LLAMA | {"rope_scaling": LLAMA3}
    new = {k: v for k, v in LLAMA.items() if k != "rope_theta"}
    new["rope_parameters"] = LLAMA3 | {"rope_theta": LLAMA["rope_theta"]}
    assert ModelConfig.from_hf_dict(old) == ModelConfig.from_hf_dict(new)
    # and what transformers 5 itself writes back parses to the same config
    written = AutoConfig.for_model(**old).to_dict()
    assert ModelConfig.from_hf_dict(written) == ModelConfig.from_hf_dict(old)
