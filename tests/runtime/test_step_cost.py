"""runtime/stats/step_cost.py: the engine's online fit of what a step costs (fixed, per prefill token,
per decoding sequence, per context token), which the router's least-latency policy reads."""

from __future__ import annotations

import math

import numpy as np
import pytest

from slimserve.runtime.stats.step_cost import MIN_STEPS, StepCost, StepCostFit

TRUE = StepCost(0.012, 4.5e-4, 5e-4, 8.5e-6)


def _steps(rng, n, prefill_choices=(0, 0, 0, 64, 300, 512)):
    for _ in range(n):
        p = int(rng.choice(prefill_choices))
        d = int(rng.integers(0, 30))
        yield p, d, d * int(rng.integers(100, 800))


def test_recovers_the_coefficients_of_noiseless_steps():
    fit, rng = StepCostFit(), np.random.default_rng(0)
    for i, (p, d, c) in enumerate(_steps(rng, 300)):
        fit.add(TRUE.step_s(p, d, c), p, d, c)
        assert (fit.estimate() is None) == (i + 1 < MIN_STEPS)
    got = fit.estimate()
    for name, want in TRUE.as_dict().items():
        assert getattr(got, name) == pytest.approx(want, rel=0.02), name


def test_noisy_steps_predict_within_a_few_percent_and_never_go_negative():
    fit, rng = StepCostFit(), np.random.default_rng(1)
    for p, d, c in _steps(rng, 600):
        fit.add(TRUE.step_s(p, d, c) * (1 + 0.2 * rng.standard_normal()), p, d, c)
    got = fit.estimate()
    assert all(v >= 0 for v in got.as_dict().values())
    for p, d, c in [(0, 16, 16 * 700), (512, 4, 400), (0, 1, 100), (300, 20, 20 * 300)]:
        assert got.step_s(p, d, c) == pytest.approx(TRUE.step_s(p, d, c), rel=0.1, abs=0.002)


def test_a_coefficient_without_recent_evidence_is_held_not_dropped():
    """After a long decode-only stretch the prefill cost is still known (forgetting alone
    would let it drift to the ridge's pull)."""
    fit, rng = StepCostFit(), np.random.default_rng(2)
    for p, d, c in _steps(rng, 200):
        fit.add(TRUE.step_s(p, d, c), p, d, c)
    for _p, d, c in _steps(rng, 2000, prefill_choices=(0,)):
        fit.add(TRUE.step_s(0, d, c), 0, d, c)
    assert fit.estimate().per_prefill_token_s == pytest.approx(TRUE.per_prefill_token_s, rel=0.05)


def test_follows_a_change_of_speed():
    fit, rng = StepCostFit(), np.random.default_rng(3)
    for p, d, c in _steps(rng, 300):
        fit.add(TRUE.step_s(p, d, c), p, d, c)
    slower = StepCost(*(2 * v for v in TRUE.as_dict().values()))
    for p, d, c in _steps(rng, 400):  # a half-life of ~70 steps
        fit.add(slower.step_s(p, d, c), p, d, c)
    assert fit.estimate().step_s(256, 16, 16 * 400) == pytest.approx(
        slower.step_s(256, 16, 16 * 400), rel=0.05
    )


def test_a_negative_dependence_is_clamped_to_zero():
    """Steps that get faster with more decoding rows (noise, or a batch-size sweet spot) do not
    give a negative cost per row, which would make a busy replica look cheap."""
    fit, rng = StepCostFit(), np.random.default_rng(4)
    for p, d, c in _steps(rng, 300):
        fit.add(max(0.001, 0.05 + 4e-4 * p - 1e-3 * d), p, d, c)
    got = fit.estimate()
    assert got.per_decode_seq_s == 0.0 and got.per_context_token_s >= 0.0
    assert got.per_prefill_token_s == pytest.approx(4e-4, rel=0.2)


@pytest.mark.parametrize(
    "body",
    [
        None,
        [],
        {},
        {"base_s": 1.0},
        dict(TRUE.as_dict(), base_s=-1.0),
        dict(TRUE.as_dict(), per_decode_seq_s=True),
        dict(TRUE.as_dict(), per_context_token_s=math.nan),
        dict(TRUE.as_dict(), per_prefill_token_s="1"),
    ],
)
def test_a_bad_reported_cost_is_ignored(body):
    assert StepCost.from_dict(body) is None


def test_a_reported_cost_round_trips():
    assert StepCost.from_dict(TRUE.as_dict()) == TRUE
    assert StepCost.from_dict({**TRUE.as_dict(), "extra": 1}) == TRUE
