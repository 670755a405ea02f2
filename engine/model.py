"""The decoder-only transformer forward over a flattened varlen batch (Llama/Mistral/Qwen2/Qwen3).

Weights come from `engine.loader.LoadedModel` under Hugging Face names and are repacked once here
(q/k/v fused, gate/up fused, each laid out for the GEMM by `engine.linear`). The KV cache is the worker's block-major tensor
`[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]`; this module writes each layer's new
K/V into it at the step's slots and reads the paged prefix back through `kernels`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import kernels
from engine.linear import Linear
from engine.model_config import ModelConfig
from engine.rope import rope_inv_freq
from engine.step_context import StepContext


@dataclass(slots=True)
class _Layer:
    input_norm: torch.Tensor
    qkv: Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_proj: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear


class CausalLM:
    """Owns the repacked weights and the rope table; stateless across steps (the KV cache is passed in)."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
        self.config = config
        self.scale = config.head_dim**-0.5
        self.q_size = config.num_attention_heads * config.head_dim
        self.kv_size = config.num_key_value_heads * config.head_dim
        self.embed = weights["model.embed_tokens.weight"]
        self.norm = weights["model.norm.weight"]
        self.lm_head = Linear.prepare(self.embed if config.tie_word_embeddings else weights["lm_head.weight"])
        self.layers = [self._layer(weights, i) for i in range(config.num_hidden_layers)]
        inv_freq, attention_scaling = rope_inv_freq(config)
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        dtype, device = self.embed.dtype, self.embed.device
        self.cos = (emb.cos() * attention_scaling).to(device=device, dtype=dtype)
        self.sin = (emb.sin() * attention_scaling).to(device=device, dtype=dtype)

    def _layer(self, w: dict[str, torch.Tensor], i: int) -> _Layer:
        p = f"model.layers.{i}."
        a = p + "self_attn."
        bias = None
        if self.config.attention_bias:
            bias = torch.cat([w[a + f"{n}_proj.bias"] for n in "qkv"])
        return _Layer(
            input_norm=w[p + "input_layernorm.weight"],
            qkv=Linear.prepare(torch.cat([w[a + f"{n}_proj.weight"] for n in "qkv"]), bias),
            q_norm=w[a + "q_norm.weight"] if self.config.qk_norm else None,
            k_norm=w[a + "k_norm.weight"] if self.config.qk_norm else None,
            o_proj=Linear.prepare(
                w[a + "o_proj.weight"], w[a + "o_proj.bias"] if self.config.o_proj_bias else None
            ),
            post_norm=w[p + "post_attention_layernorm.weight"],
            gate_up=Linear.prepare(torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]])),
            down=Linear.prepare(w[p + "mlp.down_proj.weight"]),
        )

    @torch.inference_mode()
    def forward(self, ctx: StepContext, kv_cache: torch.Tensor) -> torch.Tensor:
        """Run one step; returns float32 logits `[S, vocab]` for `ctx.sample_indices` only."""
        eps = self.config.rms_norm_eps
        cos, sin = self.cos[ctx.positions], self.sin[ctx.positions]
        # the residual stream: `residual` holds the sum so far, `hidden` the last block's output
        residual = F.embedding(ctx.input_ids, self.embed)
        x = kernels.rms_norm(residual, self.layers[0].input_norm, eps)
        for i, layer in enumerate(self.layers):
            hidden = self._attention(x, layer, ctx, kv_cache[:, i, 0], kv_cache[:, i, 1], cos, sin)
            x, residual = kernels.add_rms_norm(hidden, residual, layer.post_norm, eps)
            hidden = layer.down(kernels.silu_and_mul(layer.gate_up(x)))
            if i + 1 < len(self.layers):
                x, residual = kernels.add_rms_norm(hidden, residual, self.layers[i + 1].input_norm, eps)
        last = residual[ctx.sample_indices] + hidden[ctx.sample_indices]
        return self.lm_head(kernels.rms_norm(last, self.norm, eps)).float()

    def _attention(
        self,
        x: torch.Tensor,
        layer: _Layer,
        ctx: StepContext,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        cfg = self.config
        n = x.shape[0]
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        qkv = layer.qkv(x)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(n, heads + kv_heads, cfg.head_dim)
        v = v.reshape(n, kv_heads, cfg.head_dim)
        if layer.q_norm is not None and layer.k_norm is not None:
            q, k = qk.split([heads, kv_heads], dim=1)
            eps = cfg.rms_norm_eps
            qk = torch.cat(
                [kernels.rms_norm(q, layer.q_norm, eps), kernels.rms_norm(k, layer.k_norm, eps)], 1
            )
        qk = kernels.apply_rotary(qk, cos, sin)  # queries and keys rotate together
        q, k = qk.split([heads, kv_heads], dim=1)
        kernels.write_kv_slots(k, v, k_cache, v_cache, ctx.slot_mapping)
        if ctx.is_decode_only:
            out = kernels.paged_decode_attention(
                q, k_cache, v_cache, ctx.block_tables, ctx.seq_lens, self.scale
            )
        else:
            out = kernels.paged_prefill_attention(
                q, k_cache, v_cache, ctx.block_tables, ctx.cu_seqlens_q, ctx.seq_lens, self.scale, ctx.layout
            )
        return layer.o_proj(out.reshape(n, self.q_size))
