"""What one engine step costs, learned from the steps a worker runs: the router's per-token cost.

A step's wall time is close to linear in the tokens it computes, with a large fixed part (weights
read once per step, kernel launches, the host sync), so an average per token (time / tokens)
overstates short prompts many times over. `StepCost` fits

    step_ms ~ base_ms + tokens x us_per_token / 1000

by least squares over every step (decodes and prefill chunks alike), forgetting old steps
geometrically so the fit follows load changes. A worker's first steps are cold (allocator, thread
pool, caches: several times a warm step here) and are left out.
"""

from __future__ import annotations

from dataclasses import dataclass

_MIN_VARIANCE = 1.0  # tokens^2: below it every step had about the same size and no slope is known
EMA_WEIGHT = 0.2  # the newest step's weight in the moving averages of step costs


def ema(old: float, new: float) -> float:
    """A moving average of step costs: `new` alone first (while `old` is 0), then weighted by EMA_WEIGHT."""
    return new if old == 0.0 else (1 - EMA_WEIGHT) * old + EMA_WEIGHT * new


@dataclass(slots=True)
class StepCost:
    """Owned by the engine (`LLMEngine._observe_cost`, after each timed step); read by the role's load
    report and the scheduler's time cap.
    `alpha` is the newest step's weight in the moving moments; the first `cold_steps` are ignored."""

    alpha: float = 0.2
    cold_steps: int = 2
    _n: float = 0.0  # moving E[tokens]
    _t: float = 0.0  # moving E[ms]
    _nn: float = 0.0  # moving E[tokens^2]
    _nt: float = 0.0  # moving E[tokens x ms]
    _steps: int = 0

    def observe(self, tokens: int, ms: float) -> None:
        if self.cold_steps > 0:
            self.cold_steps -= 1
            return
        a = 1.0 if self._steps == 0 else self.alpha
        self._n += a * (tokens - self._n)
        self._t += a * (ms - self._t)
        self._nn += a * (tokens * tokens - self._nn)
        self._nt += a * (tokens * ms - self._nt)
        self._steps += 1

    @property
    def us_per_token(self) -> float:
        """Marginal cost of one more token in a step (the average per token until steps of different
        sizes give a positive slope); 0 before any step."""
        if self._steps == 0 or self._n <= 0:
            return 0.0
        variance = self._nn - self._n * self._n
        if variance > _MIN_VARIANCE:
            slope = (self._nt - self._n * self._t) / variance
            if slope > 0:
                return slope * 1e3
        return self._t / self._n * 1e3

    @property
    def base_ms(self) -> float:
        """The fixed part of a step (0 while only the average is known)."""
        return max(0.0, self._t - self._n * self.us_per_token / 1e3)
