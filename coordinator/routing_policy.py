"""The router's policy knobs (`--disaggregation`, `--local-prefill-max-tokens`, `--tpot-slo-ms`,
`--first-token-from`, `--local-first-ttft-ms`, `--ttft-slo-ms`, `--itl-stretch`); import-light, because `splitserve --help` builds the coordinator's flags from
these defaults."""

from __future__ import annotations

from dataclasses import dataclass

DISAGGREGATION = ("always", "never", "conditional")  # the first is the default
TPOT_GUARDS = ("ceiling", "increment")  # the first is the default
FIRST_TOKEN_FROM = ("decode", "prefill")  # the first is the default
ITL_STRETCH_RULE = "0 (off) or >= 1 (a multiple of the decode step)"


def valid_itl_stretch(stretch: float) -> bool:
    """Whether `stretch` is an `itl_stretch` (ITL_STRETCH_RULE; NaN is not)."""
    return stretch == 0 or stretch >= 1


@dataclass(frozen=True, slots=True)
class RoutingPolicy:
    """How a request takes the hop: when a decode worker prefills a prompt itself (coordinator/router.py
    says how it is decided) and when a shipped request's first token streams.

    `always`: every prompt is prefilled on a prefill worker and its KV shipped; `never`: every prompt
    is prefilled on its decode worker; `conditional`: per request, whichever path has the lower
    estimated TTFT, but on the decode worker only when at most `local_prefill_max_tokens` of the
    prompt are uncached there, and, with `tpot_slo_ms` > 0, only while the decode worker's projected
    TPOT with that prefill in its steps stays within `tpot_slo_ms` (0: TTFT alone decides): under
    the `ceiling` guard while every running request's projection does, under `increment` unless the
    prefill pushes a request that would meet the target without it over it. With
    `local_first_ttft_ms` > 0, `conditional` also takes the local path (when it may: short enough,
    within the TPOT guard) whenever its estimate is within that many milliseconds, even where a
    prefill worker would be sooner: short prompts then skip the hop, and the prefill workers' time
    is left to the prompts only they can serve in time (0: the lower estimate alone decides). With
    `ttft_slo_ms` > 0, `conditional` prefills a long prompt (over the decode worker's
    `--long-prefill-token-threshold`: one it would compute in chunks beside its decodes for many
    steps, stretching every running request's inter-token gaps) on the decode worker only when the
    remote path's estimate is over that TTFT target: a long prompt then stalls decode only to save
    its first token's target, as Dynamo's decode workers prefill long prompts only while the prefill
    queue is too long (0: the lower estimate decides for long prompts too). With `itl_stretch` > 0,
    `conditional` prefills on a decode worker that is decoding only while the first step carrying the
    prompt is estimated within `itl_stretch` x its decode step: a prompt that would stretch its
    running requests' next gap further goes to a prefill worker (when one can take it and its
    estimate is within `ttft_slo_ms`, where that is set), so the inter-token gaps of running requests
    stay near one decode step while prompts arrive (0: off).

    `first_token_from` (the hop's first token, prefilled on a prefill worker): `decode` streams it
    when the decode worker starts decoding the request (its KV landed, its first step scheduled), as
    vLLM's, SGLang's and Dynamo's decode instances do: the transfer and the wait for D's step
    boundary lie in TTFT and the first inter-token gap is one decode step; `prefill` streams it as
    soon as the prefill worker samples it: a lower TTFT, and a first gap that also carries the
    transfer and that wait. Created once from the flags, never changed."""

    disaggregation: str = DISAGGREGATION[0]
    local_prefill_max_tokens: int = 512
    tpot_slo_ms: float = 0.0
    tpot_guard: str = TPOT_GUARDS[0]
    first_token_from: str = FIRST_TOKEN_FROM[0]
    local_first_ttft_ms: float = 0.0
    ttft_slo_ms: float = 0.0
    itl_stretch: float = 0.0

    def __post_init__(self) -> None:
        if self.disaggregation not in DISAGGREGATION:
            raise ValueError(
                f"--disaggregation must be one of {', '.join(DISAGGREGATION)}, got {self.disaggregation!r}"
            )
        if self.local_prefill_max_tokens < 0:
            raise ValueError(f"--local-prefill-max-tokens must be >= 0, got {self.local_prefill_max_tokens}")
        if self.tpot_guard not in TPOT_GUARDS:
            raise ValueError(f"--tpot-guard must be one of {', '.join(TPOT_GUARDS)}, got {self.tpot_guard!r}")
        if self.first_token_from not in FIRST_TOKEN_FROM:
            raise ValueError(
                f"--first-token-from must be one of {', '.join(FIRST_TOKEN_FROM)}, "
                f"got {self.first_token_from!r}"
            )
        if not self.tpot_slo_ms >= 0:  # also refuses NaN
            raise ValueError(f"--tpot-slo-ms must be >= 0 (0 = off), got {self.tpot_slo_ms}")
        if not self.local_first_ttft_ms >= 0:
            raise ValueError(f"--local-first-ttft-ms must be >= 0 (0 = off), got {self.local_first_ttft_ms}")
        if not self.ttft_slo_ms >= 0:
            raise ValueError(f"--ttft-slo-ms must be >= 0 (0 = off), got {self.ttft_slo_ms}")
        if not valid_itl_stretch(self.itl_stretch):
            raise ValueError(f"--itl-stretch must be {ITL_STRETCH_RULE}, got {self.itl_stretch}")
