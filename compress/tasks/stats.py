"""Statistics for task accuracy: one accuracy's interval, and before/after on the same items.

All pure functions of 0/1 correctness vectors (or their counts):

- `wilson_interval`: the Wilson score interval of one accuracy (good at small n and near 0/1,
  where the normal interval is not);
- `mcnemar`: the exact McNemar test of a paired before/after comparison: only the discordant
  items count (b: right before, wrong after; c: wrong before, right after); under "no change"
  b ~ Binomial(b + c, 1/2); two-sided p = min(1, 2 * P(X <= min(b, c))), or the mid-p variant
  (half the probability of the observed count), which is less conservative;
- `paired_bootstrap`: a percentile interval of the accuracy difference (after - before),
  resampling items with their pair intact, seeded;
- `paired_comparison`: all of it for one task, the record a gate or a report reads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np


def _z(confidence: float) -> float:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    return NormalDist().inv_cdf(0.5 + confidence / 2.0)


def _binary(values: Sequence[float] | np.ndarray, what: str) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64).reshape(-1)
    if not np.all((arr == 0.0) | (arr == 1.0)):
        raise ValueError(f"{what} must hold only 0/1 (or False/True) values")
    return arr


def wilson_interval(correct: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval (low, high) for `correct` successes out of `n`."""
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    if not 0 <= correct <= n:
        raise ValueError(f"correct must be in [0, {n}], got {correct}")
    z = _z(confidence)
    p = correct / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    low = 0.0 if correct == 0 else max(0.0, centre - half)  # exact ends where rounding is not
    high = 1.0 if correct == n else min(1.0, centre + half)
    return low, high


@dataclass(frozen=True, slots=True)
class PairedTable:
    """The 2x2 table of paired correctness: rows before, columns after."""

    both: int  # right before and after
    lost: int  # b: right before, wrong after
    gained: int  # c: wrong before, right after
    neither: int  # wrong before and after

    @property
    def n(self) -> int:
        return self.both + self.lost + self.gained + self.neither


def paired_table(before: Sequence[float], after: Sequence[float]) -> PairedTable:
    """Counts of the four before/after outcomes of the same items (same order)."""
    a, b = _binary(before, "before"), _binary(after, "after")
    if a.shape != b.shape:
        raise ValueError(f"before has {a.size} items, after {b.size}; they must be the same items")
    return PairedTable(
        both=int(np.sum((a == 1) & (b == 1))),
        lost=int(np.sum((a == 1) & (b == 0))),
        gained=int(np.sum((a == 0) & (b == 1))),
        neither=int(np.sum((a == 0) & (b == 0))),
    )


def mcnemar(lost: int, gained: int, mid_p: bool = False) -> float:
    """Two-sided exact McNemar p-value from the discordant counts b (`lost`) and c (`gained`).

    Exact binomial arithmetic on integers, so it stays exact for thousands of discordant items.
    No discordant items: p = 1.
    """
    if lost < 0 or gained < 0:
        raise ValueError(f"counts must be non-negative, got {lost}, {gained}")
    n = lost + gained
    if n == 0:
        return 1.0
    k = min(lost, gained)
    tail = sum(math.comb(n, i) for i in range(k + 1))  # 2**n * P(X <= k)
    if mid_p:
        tail2 = 2 * tail - math.comb(n, k)  # 2 * (P(X <= k) - P(X = k) / 2), scaled by 2**n
    else:
        tail2 = 2 * tail
    return min(1.0, tail2 / 2**n)


def paired_bootstrap(
    before: Sequence[float],
    after: Sequence[float],
    *,
    resamples: int = 10_000,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float, float]:
    """(difference, low, high): mean(after - before) and its paired percentile bootstrap interval.

    Items are resampled with replacement, each keeping its before/after pair. The per-item
    difference takes few distinct values (-1, 0, 1 for correctness), so a resample is drawn as
    the multinomial counts of those values: the same distribution as resampling indices, in
    O(resamples) memory whatever the number of items. Deterministic for a given seed.
    """
    a = np.asarray(before, dtype=np.float64).reshape(-1)
    b = np.asarray(after, dtype=np.float64).reshape(-1)
    if a.shape != b.shape:
        raise ValueError(f"before has {a.size} items, after {b.size}; they must be the same items")
    if a.size == 0:
        raise ValueError("no items to compare")
    if resamples < 1:
        raise ValueError(f"resamples must be positive, got {resamples}")
    _z(confidence)  # validates confidence
    diff = b - a
    values, counts = np.unique(diff, return_counts=True)
    n = diff.size
    rng = np.random.default_rng(seed)
    draws = rng.multinomial(n, counts / n, size=resamples)  # [resamples, len(values)]
    means = draws @ values / n
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(means, [alpha, 1.0 - alpha])
    return float(diff.mean()), float(low), float(high)


@dataclass(frozen=True, slots=True)
class PairedComparison:
    """Before/after accuracy of one task on the same items, with its tests."""

    n: int
    before: float  # accuracy before
    after: float  # accuracy after
    before_ci: tuple[float, float]  # Wilson interval
    after_ci: tuple[float, float]
    table: PairedTable
    p_value: float  # exact McNemar, two-sided (mid-p when asked)
    diff: float  # after - before, as a fraction
    diff_ci: tuple[float, float]  # paired bootstrap interval of diff

    @property
    def drop_points(self) -> float:
        """The accuracy drop in points (percentage points; negative when accuracy rose)."""
        return 100.0 * (self.before - self.after)

    def significant(self, alpha: float = 0.05) -> bool:
        """True when McNemar rejects "no change" at level `alpha`."""
        return self.p_value < alpha


def paired_comparison(
    before: Sequence[float],
    after: Sequence[float],
    *,
    confidence: float = 0.95,
    mid_p: bool = False,
    resamples: int = 10_000,
    seed: int = 0,
) -> PairedComparison:
    """Everything a gate or report needs about one task's before/after correctness vectors."""
    table = paired_table(before, after)
    n = table.n
    if n == 0:
        raise ValueError("no items to compare")
    right_before, right_after = table.both + table.lost, table.both + table.gained
    diff, low, high = paired_bootstrap(
        before, after, resamples=resamples, confidence=confidence, seed=seed
    )
    return PairedComparison(
        n=n,
        before=right_before / n,
        after=right_after / n,
        before_ci=wilson_interval(right_before, n, confidence),
        after_ci=wilson_interval(right_after, n, confidence),
        table=table,
        p_value=mcnemar(table.lost, table.gained, mid_p=mid_p),
        diff=diff,
        diff_ci=(low, high),
    )
