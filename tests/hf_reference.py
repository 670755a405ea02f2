"""transformers' own greedy decoding: the reference every parity test compares against."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


class HFGreedy:
    """Loads the checkpoint once; `greedy(ids, n)` is transformers' greedy continuation of one prompt
    (no padding), stopping at EOS as our engine does."""

    def __init__(self, model_dir: Path) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def __call__(self, ids: list[int], max_new_tokens: int) -> list[int]:
        with torch.inference_mode():
            x = torch.tensor([ids])
            y = self.model.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=0,
            )
        return [int(t) for t in y[0, len(ids) :]]
