"""The step cost fit the router reads: marginal per-token cost and fixed step base, not the average."""

from __future__ import annotations

import pytest

from engine.step_cost import StepCost


def test_fit_separates_the_fixed_part_from_the_per_token_cost() -> None:
    cost = StepCost()
    cost.observe(6, 900.0)  # cold: left out
    cost.observe(1, 300.0)
    assert cost.us_per_token == cost.base_ms == 0.0
    for tokens in (1, 32, 2, 32, 3, 12, 32, 1) * 4:  # decode steps and prefill chunks: 100 ms + 1.5 ms/token
        cost.observe(tokens, 100.0 + 1.5 * tokens)
    assert cost.us_per_token == pytest.approx(1500.0)
    assert cost.base_ms == pytest.approx(100.0)
    # a 6-token prompt costs 109 ms, not 6 x the ~5,000 us a full step's average would say
    assert cost.base_ms + 6 * cost.us_per_token / 1e3 == pytest.approx(109.0)


def test_steps_of_one_size_give_the_average_and_follow_a_change() -> None:
    cost = StepCost(cold_steps=0)
    for _ in range(3):
        cost.observe(32, 160.0)
    assert (cost.us_per_token, cost.base_ms) == (pytest.approx(5000.0), 0.0)
    for _ in range(40):  # the machine got twice as slow: the moments forget the old steps
        cost.observe(32, 320.0)
    assert cost.us_per_token == pytest.approx(10_000.0, rel=1e-3)
