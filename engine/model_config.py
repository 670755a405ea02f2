"""The model configuration the engine runs: one frozen record parsed from a Hugging Face config.json.

`ModelConfig.from_hf_dict` is the only door in: it resolves each family's defaults the way transformers
does (so the engine and transformers agree on the same checkpoint) and raises `ValueError` naming the
architecture or field for anything the engine cannot run. `to_hf_dict` writes the config back in a form
transformers loads (the tiny-checkpoint maker uses it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# model_type -> the causal-LM class transformers instantiates for it
ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
# keys each scaled rope type needs, beyond rope_type (validated at parse time, used by engine.rope)
_ROPE_REQUIRED = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("original_max_position_embeddings",),
}
# transformers' per-family defaults for keys a config.json may omit
_MAX_POSITIONS = {"llama": 2048, "mistral": 131072, "qwen2": 32768, "qwen3": 32768}
_DEFAULT_HEAD_DIM = {"qwen3": 128}
_DEFAULT_BOS_EOS = {"llama": (1, 2), "mistral": (1, 2)}
_DEFAULT_WINDOW = 4096


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and numerics of a decoder-only model. Immutable; checked on construction.

    `rope_scaling` is None for plain rope, else `{"rope_type": ..., <that type's parameters>}` (never
    holds `rope_theta`). `attention_bias` means q/k/v carry a bias; for Llama and Qwen3 it also puts a
    bias on o_proj (see `o_proj_bias`), Qwen2 has q/k/v bias and none on o_proj. `sliding_window` is the
    window transformers would apply to some layer, or None; it is never shorter than
    `max_position_embeddings`, so it never masks anything inside the context.
    """

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None = field(hash=False)  # a dict: left out of the hash
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    hidden_act: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    sliding_window: int | None

    def __post_init__(self) -> None:
        arch = self.architecture
        if ARCHITECTURES.get(self.model_type) != arch:
            raise ValueError(
                f"unsupported architecture {arch!r} (model_type {self.model_type!r}); supported: "
                + ", ".join(f"{a} ({t})" for t, a in ARCHITECTURES.items())
            )
        if self.hidden_act != "silu":
            raise ValueError(f"{arch}: hidden_act={self.hidden_act!r} is not supported (only 'silu')")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{arch}: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"{arch}: head_dim={self.head_dim} must be even for rope")
        if self.sliding_window is not None and self.sliding_window < self.max_position_embeddings:
            raise ValueError(
                f"{arch}: sliding_window={self.sliding_window} is shorter than max_position_embeddings="
                f"{self.max_position_embeddings}; sliding-window attention is not supported"
            )
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ROPE_TYPES or (rope_type == "default" and self.rope_scaling is not None):
            raise ValueError(f"{arch}: rope_type {rope_type!r} is not supported; supported: {ROPE_TYPES}")
        missing = [k for k in _ROPE_REQUIRED.get(rope_type, ()) if k not in (self.rope_scaling or {})]
        if missing:
            raise ValueError(f"{arch}: rope_type {rope_type!r} needs {missing} in rope_scaling")

    @property
    def o_proj_bias(self) -> bool:
        """Whether `self_attn.o_proj` has a bias (Llama/Qwen3 with attention_bias; never Qwen2)."""
        return self.attention_bias and self.model_type != "qwen2"

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's Hugging Face name and shape (no `lm_head.weight` when tied)."""
        h, inter, d = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}."
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                shapes[p + f"self_attn.{name}.weight"] = (rows, h)
                if self.attention_bias:
                    shapes[p + f"self_attn.{name}.bias"] = (rows,)
            shapes[p + "self_attn.o_proj.weight"] = (h, q)
            if self.o_proj_bias:
                shapes[p + "self_attn.o_proj.bias"] = (h,)
            if self.qk_norm:
                shapes[p + "self_attn.q_norm.weight"] = (d,)
                shapes[p + "self_attn.k_norm.weight"] = (d,)
            shapes[p + "mlp.gate_proj.weight"] = (inter, h)
            shapes[p + "mlp.up_proj.weight"] = (inter, h)
            shapes[p + "mlp.down_proj.weight"] = (h, inter)
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Parse a config.json dict (transformers 4.x or 5.x spelling). Raises ValueError if unsupported."""
        model_type = _model_type(d)
        arch = ARCHITECTURES[model_type]

        def need(key: str) -> Any:
            if d.get(key) is None:
                raise ValueError(f"{arch}: config.json has no {key!r}")
            return d[key]

        for key, bad in (("mlp_bias", True), ("quantization_config", None)):
            if key in d and (bad is None or d[key] == bad):
                raise ValueError(f"{arch}: {key}={d[key]!r} is not supported")
        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        max_pos = int(d.get("max_position_embeddings") or _MAX_POSITIONS[model_type])
        rope_theta, rope_scaling = _rope_settings(d, arch, max_pos)
        bos_default, eos_default = _DEFAULT_BOS_EOS.get(model_type, (None, None))
        eos = d.get("eos_token_id", eos_default)
        return cls(
            architecture=arch,
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or _DEFAULT_HEAD_DIM.get(model_type, hidden // heads)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(d.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            hidden_act=str(d.get("hidden_act", "silu")),
            bos_token_id=d.get("bos_token_id", bos_default),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            torch_dtype=str(d.get("dtype") or d.get("torch_dtype") or "float32").removeprefix("torch."),
            sliding_window=_sliding_window(d, model_type),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json dict that transformers (4.x and 5.x) and `from_hf_dict` both read back."""
        ids = self.eos_token_ids
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,  # transformers mutates it
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": self.hidden_act,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": ids[0] if len(ids) == 1 else list(ids) or None,
            "torch_dtype": self.torch_dtype,
        }
        if self.model_type in ("llama", "qwen3"):
            d["attention_bias"] = self.attention_bias
        if self.model_type == "llama":
            d["mlp_bias"] = False
        if self.model_type != "llama":
            d["sliding_window"] = self.sliding_window
        if self.model_type in ("qwen2", "qwen3"):
            d["use_sliding_window"] = self.sliding_window is not None
            d["max_window_layers"] = 0 if self.sliding_window is not None else self.num_hidden_layers
        return d


def _model_type(d: dict[str, Any]) -> str:
    archs = d.get("architectures") or []
    model_type = d.get("model_type")
    if model_type in ARCHITECTURES and (not archs or archs == [ARCHITECTURES[model_type]]):
        return str(model_type)
    raise ValueError(
        f"unsupported architecture {archs or None} (model_type {model_type!r}); supported: "
        + ", ".join(f"{a} ({t})" for t, a in ARCHITECTURES.items())
    )


def _rope_settings(d: dict[str, Any], arch: str, max_pos: int) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, normalised rope_scaling) from either spelling.

    transformers 4.x writes `rope_theta` + `rope_scaling` (type under "type" or "rope_type"); 5.x writes
    one `rope_parameters` dict holding rope_theta too. Like transformers, a non-empty `rope_scaling` wins.
    """
    new = d.get("rope_parameters") or {}
    params = dict(d.get("rope_scaling") or new)
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"{arch}: per-layer-type rope parameters are not supported")
    theta = float(params.pop("rope_theta", None) or d.get("rope_theta") or new.get("rope_theta") or 10000.0)
    legacy_type = params.pop("type", None)
    rope_type = params.pop("rope_type", None) or legacy_type or "default"
    partial = params.pop("partial_rotary_factor", None) or d.get("partial_rotary_factor") or 1.0
    if partial != 1.0:
        raise ValueError(f"{arch}: partial_rotary_factor={partial} is not supported")
    if rope_type == "default":
        return theta, None
    if rope_type in ("llama3", "yarn"):
        params.setdefault(
            "original_max_position_embeddings", d.get("original_max_position_embeddings", max_pos)
        )
    return theta, {"rope_type": rope_type, **params}


def _sliding_window(d: dict[str, Any], model_type: str) -> int | None:
    """The window transformers applies to at least one layer, or None (same defaults as transformers)."""
    if model_type == "llama":
        return None
    if model_type == "mistral":
        window = d.get("sliding_window", _DEFAULT_WINDOW)
        return None if window is None else int(window)
    if not d.get("use_sliding_window", False) or d.get("sliding_window", _DEFAULT_WINDOW) is None:
        return None
    layer_types = d.get("layer_types")
    if layer_types is None:
        used = int(d["num_hidden_layers"]) > int(d.get("max_window_layers", 28))
    else:
        used = "sliding_attention" in layer_types
    return int(d.get("sliding_window", _DEFAULT_WINDOW)) if used else None
