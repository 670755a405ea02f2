"""Turns a scheduler output into one model step: metadata tensors, forward, sampling."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels.dispatch
from engine.kv_manager import KVCacheManager
from engine.model import CausalLM
from engine.sampler import Sampler, SamplingBatch
from engine.scheduler import ScheduledSequence, SchedulerOutput
from engine.sequence import Sequence
from engine.step_context import StepContext
from kernels import host_memory
from kernels.attention import VarlenLayout


@dataclass(slots=True)
class StepResult:
    """Sampled token and its logprob for each sequence that sampled this step."""

    sampled: dict[Sequence, tuple[int, float]]
    top_logprobs: dict[Sequence, list[tuple[int, float]]]


class ModelRunner:
    """Owns the worker's KV cache tensor (allocated once) and runs steps on it.

    Activations live only inside `execute`; the KV cache outlives every step. Not thread-safe: one
    step at a time.
    """

    def __init__(
        self,
        model: CausalLM,
        kv: KVCacheManager,
        num_blocks: int,
        eos_token_ids: tuple[int, ...],
        device: torch.device,
    ) -> None:
        cfg = model.config
        self.model = model
        self.kv = kv
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.sampler = Sampler()
        self.kv_cache = host_memory.zeros(
            (num_blocks, cfg.num_hidden_layers, 2, kv.block_size, cfg.num_key_value_heads, cfg.head_dim),
            model.embed.dtype,
            device,
        )
        # share of the cache on huge pages (None: a device cache, or no /proc); logged, and a metric
        self.kv_cache_huge_page_share = host_memory.report_backing(self.kv_cache, "kv cache")
        # build or load the C++ CPU kernels now (a first build takes ~25 s), not in the first step
        kernels.dispatch.cpu_kernels(self.kv_cache)

    def prepare(self, scheduled: list[ScheduledSequence]) -> StepContext:
        """Flatten the scheduled chunks, in this order, into the step's metadata (one host-to-device
        copy per field) and, for a step with prompt chunks, its attention layout."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        cu = [0]
        sample_indices: list[int] = []
        for item in scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(self.kv.slot(seq, p) for p in range(start, end))
            seq_lens.append(end)
            cu.append(cu[-1] + item.num_new_tokens)
            if item.samples:
                sample_indices.append(cu[-1] - 1)
        width = max(len(item.seq.block_table) for item in scheduled)
        tables = [item.seq.block_table + [0] * (width - len(item.seq.block_table)) for item in scheduled]

        def t(values: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        block_tables = t(tables, torch.int32)
        decode_only = len(input_ids) == len(scheduled)
        q_lens = [item.num_new_tokens for item in scheduled]
        return StepContext(
            input_ids=t(input_ids, torch.int64),
            positions=t(positions, torch.int64),
            slot_mapping=t(slots, torch.int64),
            block_tables=block_tables,
            seq_lens=t(seq_lens, torch.int32),
            cu_seqlens_q=t(cu, torch.int32),
            sample_indices=t(sample_indices, torch.int64),
            layout=None
            if decode_only
            else VarlenLayout.build(q_lens, seq_lens, block_tables, self.kv.block_size),
        )

    def execute(self, out: SchedulerOutput) -> StepResult:
        # decode tokens first: a mixed step's decode rows are then one slice for the decode kernel
        scheduled = sorted(out.scheduled, key=lambda item: item.num_new_tokens != 1)
        ctx = self.prepare(scheduled)
        logits = self.model.forward(ctx, self.kv_cache)
        samplers = [item.seq for item in scheduled if item.samples]
        if not samplers:
            return StepResult({}, {})
        batch = SamplingBatch.build(
            params=[s.params for s in samplers],
            generators=[s.generator for s in samplers],
            prompt_ids=[s.prompt_token_ids for s in samplers],
            output_ids=[s.output_token_ids for s in samplers],
            eos_token_ids=self.eos_token_ids,
            vocab_size=logits.shape[-1],
            device=self.device,
        )
        result = self.sampler(logits, batch)
        tokens = result.token_ids.tolist()  # the step's one device-to-host sync
        logprobs = result.logprobs.tolist()
        sampled = {s: (tok, lp) for s, tok, lp in zip(samplers, tokens, logprobs, strict=True)}
        top: dict[Sequence, list[tuple[int, float]]] = {}
        if result.top_ids is not None and result.top_logprobs is not None:
            ids, vals = result.top_ids.tolist(), result.top_logprobs.tolist()
            for row, s in enumerate(samplers):
                if s.params.logprobs:
                    k = s.params.logprobs
                    top[s] = list(zip(ids[row][:k], vals[row][:k], strict=True))
        return StepResult(sampled, top)
