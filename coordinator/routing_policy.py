"""The router's policy knobs (`--disaggregation`, `--local-prefill-max-tokens`, `--tpot-slo-ms`); import-light, because
`splitserve --help` builds the coordinator's flags from these defaults."""

from __future__ import annotations

from dataclasses import dataclass

DISAGGREGATION = ("always", "never", "conditional")  # the first is the default
TPOT_GUARDS = ("ceiling", "increment")  # the first is the default


@dataclass(frozen=True, slots=True)
class RoutingPolicy:
    """When a decode worker prefills a prompt itself (coordinator/router.py says how it is decided).

    `always`: every prompt is prefilled on a prefill worker and its KV shipped; `never`: every prompt
    is prefilled on its decode worker; `conditional`: per request, whichever path has the lower
    estimated TTFT, but on the decode worker only when at most `local_prefill_max_tokens` of the
    prompt are uncached there, and, with `tpot_slo_ms` > 0, only while the decode worker's projected
    TPOT with that prefill in its steps stays within `tpot_slo_ms` (0: TTFT alone decides): under
    the `ceiling` guard while every running request's projection does, under `increment` unless the
    prefill pushes a request that would meet the target without it over it. Created once from the
    flags, never changed."""

    disaggregation: str = DISAGGREGATION[0]
    local_prefill_max_tokens: int = 512
    tpot_slo_ms: float = 0.0
    tpot_guard: str = TPOT_GUARDS[0]

    def __post_init__(self) -> None:
        if self.disaggregation not in DISAGGREGATION:
            raise ValueError(
                f"--disaggregation must be one of {', '.join(DISAGGREGATION)}, got {self.disaggregation!r}"
            )
        if self.local_prefill_max_tokens < 0:
            raise ValueError(f"--local-prefill-max-tokens must be >= 0, got {self.local_prefill_max_tokens}")
        if self.tpot_guard not in TPOT_GUARDS:
            raise ValueError(f"--tpot-guard must be one of {', '.join(TPOT_GUARDS)}, got {self.tpot_guard!r}")
        if not self.tpot_slo_ms >= 0:  # also refuses NaN
            raise ValueError(f"--tpot-slo-ms must be >= 0 (0 = off), got {self.tpot_slo_ms}")
