"""The one object that carries a step's attention metadata through the model.

Index map for a step that mixes a prefill chunk of 3 new tokens (seq 0, 5 tokens already cached)
with two decode tokens (seqs 1 and 2)::

    flat token index t     0  1  2 | 3 | 4
    cu_seqlens_q           0        3   4   5
    positions              5  6  7 | 9 | 2
    seq_lens (kv, incl. new)   8    | 10 | 3
    slot_mapping           block_table[pos // B] * B + pos % B for each t
    sample_indices         [2, 3, 4]   (last token of each sequence that samples this step)

(The runner puts decode tokens first, so a mixed step's decode rows are one slice.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.attention import VarlenLayout


@dataclass(slots=True)
class StepContext:
    """Created by the model runner for one step, read by every layer, dropped after the step."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [B] int32: kv length per sequence including this step's tokens
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    sample_indices: torch.Tensor  # [S] int64 into the flat tokens
    layout: VarlenLayout | None  # a step with prompt chunks: its rows, for every layer; None: decode only

    @property
    def is_decode_only(self) -> bool:
        """Every sequence contributes exactly one token."""
        return self.layout is None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
