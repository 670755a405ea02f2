"""What prefill and decode share: model loading, the forward, the KV pool, sampling, scheduling.

`from engine import LLM, SamplingParams` is the offline API; both names load lazily so that the
light modules (block pool, configs) import without torch's start-up cost.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.llm import LLM, RequestOutput
    from engine.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name in ("LLM", "RequestOutput"):
        from engine import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
