"""What one engine step costs, as a linear model of the work in it, fit online from the engine's
own steps; a router predicts a replica's time to first token from it (runtime/router/policy.py).

    seconds = base_s
            + per_prefill_token_s x prompt tokens the step computes (prefill chunks)
            + per_decode_seq_s    x sequences the step decodes one token for
            + per_context_token_s x the context tokens of those sequences (attention reads them)

The terms follow where a step's time goes: a fixed part (launches, the sampler, reading the
weights once), work per prefill token, work per decoding row, and attention over each decoding
row's KV, which grows with its context. A decode step with 16 rows of 700 tokens costs several
times one with 16 rows of 100; a model with the first two terms only, or a moving average of
recent step times, misses that and lags behind a batch that fills up.

`StepCostFit` is recursive least squares with forgetting (each new step weighs 1, older ones
`forget` times less per step: a half-life of about 70 steps at 0.99), on features scaled to one
magnitude. A coefficient the recent steps say little about (no prefill for a while) is held near
its last value instead of drifting to zero: every diagonal entry of the normal matrix is kept at
least `MIN_INFORMATION` (plus a small ridge, so it is never singular), pulled towards the
previous solution. Coefficients are never negative
(a negative one is fixed at zero and the rest solved again).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

FIELDS = ("base_s", "per_prefill_token_s", "per_decode_seq_s", "per_context_token_s")
_SCALE = np.array([1.0, 256.0, 16.0, 4096.0])  # a typical step's features: solved at one magnitude
MIN_INFORMATION = 1.0  # floor of each diagonal entry of the (scaled) normal matrix
RIDGE = 1e-3  # added to every diagonal entry, towards the last solution
MIN_STEPS = 8  # steps measured before the fit is reported
FORGET = 0.99


@dataclass(frozen=True)
class StepCost:
    base_s: float
    per_prefill_token_s: float
    per_decode_seq_s: float = 0.0
    per_context_token_s: float = 0.0

    def step_s(self, prefill_tokens: float, decode_seqs: float, context_tokens: float) -> float:
        return (
            self.base_s
            + self.per_prefill_token_s * prefill_tokens
            + self.per_decode_seq_s * decode_seqs
            + self.per_context_token_s * context_tokens
        )

    def as_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in FIELDS}

    @classmethod
    def from_dict(cls, body: Any) -> StepCost | None:
        """The cost a replica reported; None unless every field is a finite number >= 0."""
        if not isinstance(body, dict):
            return None
        values = [body.get(name) for name in FIELDS]
        if not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
            for v in values
        ):
            return None
        return cls(*map(float, values))


class StepCostFit:
    """Online fit of StepCost (module doc). `add` after every step; `estimate` reads it."""

    def __init__(self, forget: float = FORGET, min_steps: int = MIN_STEPS) -> None:
        self.forget = forget
        self.min_steps = min_steps
        self.steps = 0
        self._a = np.zeros((4, 4))
        self._b = np.zeros(4)
        self._theta = np.zeros(4)  # scaled coefficients of the last solve
        self._estimate: StepCost | None = None

    def add(
        self, seconds: float, prefill_tokens: int, decode_seqs: int, context_tokens: int
    ) -> None:
        x = np.array([1.0, prefill_tokens, decode_seqs, context_tokens]) / _SCALE
        self._a = self.forget * self._a + np.outer(x, x)
        self._b = self.forget * self._b + x * seconds
        self.steps += 1
        if self.steps == 1:
            self._theta[0] = seconds  # the first pull: all of it fixed cost
        self._theta = self._solve()
        if self.steps >= self.min_steps:
            self._estimate = StepCost(*(float(v) for v in self._theta / _SCALE))

    def estimate(self) -> StepCost | None:
        """The fitted cost; None before `min_steps` steps."""
        return self._estimate

    def _solve(self) -> np.ndarray:
        a, b = self._a.copy(), self._b.copy()
        # little recent evidence: hold near the last solution (and a small ridge, never singular)
        short = np.maximum(MIN_INFORMATION - np.diag(a), 0.0) + RIDGE
        a[np.diag_indices(4)] += short
        b += short * self._theta
        free = np.ones(4, dtype=bool)
        theta = np.zeros(4)
        while free.any():
            theta[:] = 0.0
            theta[free] = np.linalg.solve(a[np.ix_(free, free)], b[free])
            negative = free & (theta < 0)
            if not negative.any():
                break
            free &= ~negative
        return theta
