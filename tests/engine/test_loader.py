"""engine.loader and engine.model_config: checkpoints load as transformers loads them, or fail clearly."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from engine.loader import load_config, load_model, model_identity
from engine.model_config import ModelConfig
from engine.shapes import SHAPES

TINY = ["llama-2l", "qwen2-2l", "qwen3-2l", "mistral-2l"]

# abridged config.json files of public checkpoints (transformers 4.x spelling)
LLAMA_31_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}
QWEN25_05B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 21,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 151936,
}
QWEN3_06B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 151936,
}
MISTRAL_7B_V03: dict[str, Any] = {
    "architectures": ["MistralForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 32768,
}
REAL_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": LLAMA_31_8B,
    "llama-attention-bias": LLAMA_31_8B | {"attention_bias": True, "rope_scaling": None},
    "qwen2.5-0.5b": QWEN25_05B,
    "qwen2.5-yarn": QWEN25_05B
    | {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
    "qwen3-0.6b": QWEN3_06B,
    "qwen3-no-head-dim": {k: v for k, v in QWEN3_06B.items() if k != "head_dim"},
    "mistral-7b-v0.3": MISTRAL_7B_V03,
}


def hf_expected(d: dict[str, Any]) -> dict[str, Any]:
    """What transformers makes of a config.json dict, in ModelConfig's terms."""
    hf = AutoConfig.for_model(**d)
    layer_types = getattr(hf, "layer_types", None) or ["sliding_attention"]
    window = getattr(hf, "sliding_window", None) if "sliding_attention" in layer_types else None
    eos = hf.eos_token_id
    return {
        "head_dim": getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        "num_key_value_heads": hf.num_key_value_heads,
        "rope_theta": hf.rope_parameters["rope_theta"],
        "rope_type": hf.rope_parameters["rope_type"],
        "max_position_embeddings": hf.max_position_embeddings,
        "tie_word_embeddings": hf.tie_word_embeddings,
        "rms_norm_eps": hf.rms_norm_eps,
        "bos_token_id": hf.bos_token_id,
        "eos_token_ids": tuple(eos if isinstance(eos, list) else [eos]),
        "sliding_window": window,
    }


@pytest.mark.parametrize("name", REAL_CONFIGS)
def test_config_agrees_with_transformers(name: str) -> None:
    d = REAL_CONFIGS[name]
    config = ModelConfig.from_hf_dict(d)
    ours = {k: getattr(config, k) for k in hf_expected(d) if k != "rope_type"}
    ours["rope_type"] = (config.rope_scaling or {"rope_type": "default"})["rope_type"]
    assert ours == hf_expected(d)
    # the parameter list equals what the transformers class instantiates (on the meta device: no memory)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**d | {"num_hidden_layers": 2}))
    state = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight")
    two_layers = ModelConfig.from_hf_dict(d | {"num_hidden_layers": 2})
    assert two_layers.parameter_shapes() == state


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_shape_round_trips_through_hf_dict(shape: str) -> None:
    config = SHAPES[shape]
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config
    assert ModelConfig.from_hf_dict(AutoConfig.for_model(**config.to_hf_dict()).to_dict()) == config


UNSUPPORTED: dict[str, dict[str, Any]] = {
    "GPT2LMHeadModel": {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"},
    "unsupported architecture": LLAMA_31_8B | {"architectures": ["Qwen2ForCausalLM"]},
    "hidden_act='gelu'": LLAMA_31_8B | {"hidden_act": "gelu"},
    "mlp_bias=True": LLAMA_31_8B | {"mlp_bias": True},
    "quantization_config": LLAMA_31_8B | {"quantization_config": {"quant_method": "awq"}},
    "'longrope' is not supported": LLAMA_31_8B | {"rope_scaling": {"rope_type": "longrope", "factor": 2.0}},
    "partial_rotary_factor=0.5": LLAMA_31_8B | {"partial_rotary_factor": 0.5},
    "sliding_window=4096 is shorter": MISTRAL_7B_V03 | {"sliding_window": 4096},
    "sliding_window=1024 is shorter": QWEN25_05B
    | {"use_sliding_window": True, "sliding_window": 1024, "max_window_layers": 0},
    "not a multiple of num_key_value_heads=3": LLAMA_31_8B | {"num_key_value_heads": 3},
    "no 'vocab_size'": {k: v for k, v in LLAMA_31_8B.items() if k != "vocab_size"},
    "needs \\['low_freq_factor'": LLAMA_31_8B | {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
}


@pytest.mark.parametrize("match", UNSUPPORTED)
def test_unsupported_config_is_a_clear_value_error(match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict(UNSUPPORTED[match])


def test_unused_sliding_window_is_accepted() -> None:
    # Qwen2.5 names a window but does not use it; Qwen2 using it only above layer 21 of 24 is rejected
    assert ModelConfig.from_hf_dict(QWEN25_05B).sliding_window is None
    with pytest.raises(ValueError, match="sliding_window"):
        ModelConfig.from_hf_dict(QWEN25_05B | {"use_sliding_window": True, "sliding_window": 4096})


@pytest.mark.parametrize("shape", TINY)
def test_loader_agrees_with_transformers(shape: str, tiny_model_dir: Callable[[str], Path]) -> None:
    model_dir = tiny_model_dir(shape)
    loaded = load_model(model_dir)
    config = loaded.config
    assert config == ModelConfig.from_hf_dict(json.loads((model_dir / "config.json").read_text()))
    assert set(loaded.weights) == set(config.parameter_shapes())
    assert ("lm_head.weight" in loaded.weights) == (not config.tie_word_embeddings)
    hf_state = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    if config.tie_word_embeddings:
        assert hf_state.pop("lm_head.weight").data_ptr() == hf_state["model.embed_tokens.weight"].data_ptr()
    assert hf_state.keys() == loaded.weights.keys()
    for name, tensor in loaded.weights.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, hf_state[name]), name
    assert len(loaded.tokenizer) == config.vocab_size
    assert loaded.identity == model_identity(model_dir)


def test_dtype_and_generation_eos(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    model_dir = shutil.copytree(tiny_model_dir("llama-2l"), tmp_path / "m")
    loaded = load_model(model_dir, dtype=torch.bfloat16)
    assert {t.dtype for t in loaded.weights.values()} == {torch.bfloat16}
    gen = json.loads((model_dir / "generation_config.json").read_text())
    (model_dir / "generation_config.json").write_text(json.dumps(gen | {"eos_token_id": [4, 9]}))
    assert load_config(model_dir).eos_token_ids == (*SHAPES["llama-2l"].eos_token_ids, 9)
    assert model_identity(model_dir) != model_identity(tiny_model_dir("llama-2l"))


def test_sharded_checkpoint_loads_the_same_weights(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    source = tiny_model_dir("qwen2-2l")
    model_dir = shutil.copytree(source, tmp_path / "sharded")
    tensors = load_file(model_dir / "model.safetensors")
    (model_dir / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(model_dir / file), metadata={"format": "pt"})
    weight_map = {n: file for file, shard_names in shards.items() for n in shard_names}
    (model_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    loaded = load_model(model_dir)
    assert loaded.weights.keys() == tensors.keys()
    assert all(torch.equal(loaded.weights[n], t) for n, t in tensors.items())
    assert loaded.identity == model_identity(model_dir) != model_identity(source)
    # the documented definition (engine/loader.py), computed here in one thread, in order
    parts = [*shards, "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"]
    parts += ["generation_config.json"]
    sha = hashlib.sha256()
    for name in parts:
        if (model_dir / name).is_file():
            data = (model_dir / name).read_bytes()
            sha.update(f"{name}\0{len(data)}\0".encode() + hashlib.sha256(data).digest())
    assert loaded.identity == sha.hexdigest()


def test_identity_is_stable_across_processes(tiny_model_dir: Callable[[str], Path]) -> None:
    model_dir = tiny_model_dir("llama-2l")
    code = "import sys; from engine.loader import load_model; print(load_model(sys.argv[1]).identity)"
    other = subprocess.run(
        [sys.executable, "-c", code, str(model_dir)], capture_output=True, text=True, check=True
    ).stdout.split()[-1]
    assert other == model_identity(model_dir) == load_model(model_dir).identity
    assert len(other) == 64 and int(other, 16) >= 0


def test_identity_follows_template_weights_and_tokenizer(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    source = tiny_model_dir("llama-2l")
    base = model_identity(source)
    seen = {base}

    template_dir = shutil.copytree(source, tmp_path / "template")
    tok_config = json.loads((template_dir / "tokenizer_config.json").read_text())
    tok_config["chat_template"] = tok_config["chat_template"].replace("<|im_end|>", "<|im_end|><|im_end|>")
    (template_dir / "tokenizer_config.json").write_text(json.dumps(tok_config))
    loaded = load_model(template_dir)
    assert loaded.chat_template == tok_config["chat_template"]
    seen.add(loaded.identity)

    weights_dir = shutil.copytree(source, tmp_path / "weights")
    tensors = load_file(weights_dir / "model.safetensors")
    tensors["model.norm.weight"][0] += 1.0
    save_file(tensors, str(weights_dir / "model.safetensors"), metadata={"format": "pt"})
    seen.add(model_identity(weights_dir))

    jinja_dir = shutil.copytree(source, tmp_path / "jinja")
    (jinja_dir / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    seen.add(model_identity(jinja_dir))
    assert len(seen) == 4


def test_missing_pieces_are_clear_errors(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_model(empty)
    no_weights = shutil.copytree(tiny_model_dir("llama-2l"), tmp_path / "no-weights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors or model\.safetensors\.index\.json"):
        load_model(no_weights)
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors"):
        model_identity(no_weights)


def test_wrong_tensors_are_named(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    model_dir = shutil.copytree(tiny_model_dir("llama-2l"), tmp_path / "m")
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.0.mlp.gate_proj.bias"] = torch.zeros(SHAPES["llama-2l"].intermediate_size)
    tensors["model.norm.weight"] = torch.ones(3)
    save_file(tensors, str(model_dir / "model.safetensors"))
    with pytest.raises(ValueError) as err:
        load_model(model_dir)
    message = str(err.value)
    assert "missing tensors ['model.layers.1.mlp.up_proj.weight']" in message
    assert "unexpected tensors ['model.layers.0.mlp.gate_proj.bias']" in message
    assert "model.norm.weight (3,) != (64,)" in message

    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | {"architectures": ["FalconForCausalLM"]}))
    with pytest.raises(ValueError, match=r"config\.json: unsupported architecture \['FalconForCausalLM'\]"):
        load_model(model_dir)


def test_a_serving_engine_loads_without_transformers(tiny_model_dir: Callable[[str], Path]) -> None:
    """Workers never tokenize (the coordinator does): their modules, loading the checkpoint and
    building the engine must not import transformers (its AutoTokenizer costs a worker ~3 s at start); the tokenizer
    loads on first use and is the checkpoint's."""
    probe = (
        "import sys\n"
        "import decode.worker, engine.worker.process, prefill.worker\n"
        "from engine.config import EngineConfig\n"
        "from engine.llm_engine import LLMEngine\n"
        "from engine.loader import load_model\n"
        f"loaded = load_model({str(tiny_model_dir('llama-2l'))!r})\n"
        "LLMEngine(loaded, EngineConfig(num_blocks=8))\n"
        "print('PROBE', 'transformers' in sys.modules)\n"
        "print('PROBE', len(loaded.tokenizer), 'transformers' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    before, after = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")]
    assert before == "PROBE False"
    assert after == f"PROBE {SHAPES['llama-2l'].vocab_size} True"
