"""Task statistics: per-item scoring and aggregation (lm-eval's rules), McNemar, bootstrap, Wilson.

Expected values are computed by hand in the comments (binomial tails as integer counts / 2**n).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from slimserve.compress.tasks.catalog import (
    Accuracy,
    Item,
    accuracy,
    aggregate,
    group_accuracy,
    mean_stderr,
    pooled_stderr,
    score_choices,
    score_item,
)
from slimserve.compress.tasks.stats import (
    PairedTable,
    mcnemar,
    paired_bootstrap,
    paired_comparison,
    paired_table,
    wilson_interval,
)

# --- scoring one item -------------------------------------------------------------------------


def test_acc_and_acc_norm_pick_different_choices():
    # ll = [-10, -8, -9]: argmax 1; ll / len = [-1, -4, -0.45]: argmax 2
    s = score_choices([-10.0, -8.0, -9.0], [10, 2, 20], gold=2)
    assert (s.pred, s.pred_norm, s.acc, s.acc_norm) == (1, 2, 0.0, 1.0)
    assert s.exact_match is None


def test_ties_go_to_the_first_choice_like_numpy_argmax():
    s = score_choices([-3.0, -3.0, -5.0], [3, 3, 1], gold=1)
    assert s.pred == 0 and s.acc == 0.0
    assert s.pred_norm == int(np.argmax(np.array([-3.0, -3.0, -5.0]) / np.array([3, 3, 1])))


def test_exact_match_reads_gold_greedy_flag():
    assert score_choices([-1.0, -2.0], [1, 1], 1, is_greedy=[True, False]).exact_match == 0.0
    assert score_choices([-1.0, -2.0], [1, 1], 0, is_greedy=[True, False]).exact_match == 1.0


def test_score_item_checks_the_number_of_choices():
    item = Item("piqa", 0, ("c", "c"), (" a", " bb"), 1, (1, 2))
    s = score_item(item, [-2.0, -3.0])  # acc: 0; acc_norm: -2/1 < -3/2 -> 1
    assert (s.acc, s.acc_norm) == (0.0, 1.0)
    with pytest.raises(ValueError, match="3 log-likelihoods for 2 choices"):
        score_item(item, [-1.0, -2.0, -3.0])


# --- aggregation, as lm-eval aggregates ---------------------------------------------------------


def test_accuracy_and_lm_eval_stderr():
    # mean 0.75; deviations .25, -.75, .25, .25 -> sum of squares .75; /3 -> .25; sd .5; /2 -> .25
    acc = accuracy([1.0, 0.0, 1.0, 1.0])
    assert acc == Accuracy(0.75, 0.25, 4)
    assert math.isnan(mean_stderr([1.0]))
    with pytest.raises(ValueError):
        accuracy([])


def test_group_is_size_weighted_with_pooled_stderr():
    a = accuracy([1.0, 0.0, 1.0, 0.0])  # 0.5, n = 4
    b = accuracy([1.0, 1.0])  # 1.0, n = 2, stderr 0
    g = group_accuracy([a, b])
    assert g.value == pytest.approx(4 / 6) and g.n == 6
    # lm-eval's pooled_sample_stderr: sqrt(((4-1)*se_a^2*4 + (2-1)*0*2) / (6-2) / 6)
    assert g.stderr == pytest.approx(math.sqrt(3 * a.stderr**2 * 4 / 4 / 6))
    assert pooled_stderr([a.stderr, b.stderr], [4, 2]) == pytest.approx(g.stderr)
    assert group_accuracy([a]) == a


def test_pooled_stderr_is_close_to_the_concatenated_one_for_similar_parts():
    rng = np.random.default_rng(1)
    parts = [rng.random(n) < 0.6 for n in (300, 500, 200)]
    pooled = group_accuracy([accuracy(p.astype(float).tolist()) for p in parts])
    flat = accuracy(np.concatenate(parts).astype(float).tolist())
    assert pooled.value == pytest.approx(flat.value)
    assert pooled.stderr == pytest.approx(flat.stderr, rel=0.02)


def test_aggregate_task_and_group(monkeypatch):
    from slimserve.compress.tasks import catalog

    items = [Item("piqa", i, ("c",) * 2, (" a", " bb"), 0, (1, 2)) for i in range(3)]
    scores = [score_item(it, lp) for it, lp in zip(items, ([-1, -2], [-2, -1], [-1.2, -2.0]))]
    out = aggregate("piqa", items, scores)
    assert set(out) == {"acc", "acc_norm"}
    assert out["acc"].value == pytest.approx(2 / 3) and out["acc"].n == 3
    # acc_norm: [-1, -1] -> 0 (tie), [-2, -0.5] -> 1, [-1.2, -1] -> 1
    assert out["acc_norm"].value == pytest.approx(1 / 3)

    monkeypatch.setitem(catalog.GROUPS, "mmlu", ("mmlu_anatomy", "mmlu_virology"))
    mm = [
        Item(t, i, ("q",) * 4, (" A", " B", " C", " D"), 0, (1,) * 4)
        for t, i in [("mmlu_anatomy", 0), ("mmlu_anatomy", 1), ("mmlu_virology", 0)]
    ]
    ss = [
        score_choices(lp, (1,) * 4, 0) for lp in ([0, -1, -1, -1], [-1, 0, -1, -1], [0, -1, -2, -3])
    ]
    out = aggregate("mmlu", mm, ss)
    assert set(out) == {"acc"} and out["acc"].value == pytest.approx(2 / 3) and out["acc"].n == 3


# --- McNemar ---------------------------------------------------------------------------------


def test_mcnemar_known_tables():
    # b=10, c=2: n=12, P(X<=2) = (1 + 12 + 66) / 4096 = 79/4096; two-sided 158/4096 = 0.0386
    assert mcnemar(10, 2) == pytest.approx(158 / 4096)
    assert round(mcnemar(10, 2), 4) == 0.0386
    assert mcnemar(2, 10) == mcnemar(10, 2)
    # mid-p: 2 * (79 - 66/2) / 4096 = 92/4096
    assert mcnemar(10, 2, mid_p=True) == pytest.approx(92 / 4096)
    # b=3, c=12: P(X<=3) = (1 + 15 + 105 + 455) / 32768 = 576/32768; two-sided 0.03516
    assert mcnemar(3, 12) == pytest.approx(1152 / 32768)
    assert mcnemar(0, 5) == pytest.approx(2 / 32)  # 0.0625: 5 discordant of one kind is not enough
    assert mcnemar(0, 6) == pytest.approx(2 / 64)  # 0.03125
    assert mcnemar(5, 5) == 1.0  # capped
    assert mcnemar(0, 0) == 1.0
    assert mcnemar(0, 1) == 1.0 and mcnemar(0, 1, mid_p=True) == pytest.approx(0.5)


def test_mcnemar_large_counts_stay_exact_and_near_the_chi_square():
    p = mcnemar(1000, 1100)
    chi2 = (abs(1000 - 1100) - 1) ** 2 / 2100  # continuity-corrected statistic, 1 dof
    assert p == pytest.approx(math.erfc(math.sqrt(chi2 / 2)), abs=0.003)
    assert 0.0 < mcnemar(0, 3000) < 1e-300 or mcnemar(0, 3000) == 0.0
    with pytest.raises(ValueError):
        mcnemar(-1, 2)


def test_paired_table_counts():
    before = [1, 1, 1, 0, 0, 1, 0]
    after = [1, 0, 0, 1, 0, 1, 0]
    assert paired_table(before, after) == PairedTable(both=2, lost=2, gained=1, neither=2)
    assert paired_table([True, False], [False, False]).lost == 1
    with pytest.raises(ValueError, match="same items"):
        paired_table([1, 0], [1])
    with pytest.raises(ValueError, match="0/1"):
        paired_table([0.5], [1])


# --- Wilson ----------------------------------------------------------------------------------


def test_wilson_known_values():
    low, high = wilson_interval(5, 10)  # centre .5, half-width 1.96/1.3842 * sqrt(.025 + .0096)
    assert (low, high) == (pytest.approx(0.2366, abs=1e-4), pytest.approx(0.7634, abs=1e-4))
    z2 = 1.959964**2
    assert wilson_interval(0, 10) == (0.0, pytest.approx(z2 / (10 + z2), abs=1e-6))  # 0.2775
    assert wilson_interval(10, 10) == (pytest.approx(10 / (10 + z2), abs=1e-6), 1.0)
    with pytest.raises(ValueError):
        wilson_interval(3, 0)
    with pytest.raises(ValueError):
        wilson_interval(4, 3)


@pytest.mark.parametrize(("k", "n"), [(1, 7), (30, 100), (280, 300), (6000, 14042)])
def test_wilson_bounds_solve_the_score_equation(k, n):
    z = 1.959964
    p = k / n
    for bound in wilson_interval(k, n):
        assert abs(p - bound) / math.sqrt(bound * (1 - bound) / n) == pytest.approx(z, rel=1e-5)


# --- bootstrap and the full comparison -------------------------------------------------------


def _pairs(both, lost, gained, neither):
    before = [1] * both + [1] * lost + [0] * gained + [0] * neither
    after = [1] * both + [0] * lost + [1] * gained + [0] * neither
    return before, after


def test_bootstrap_interval_of_the_difference():
    before, after = _pairs(55, 15, 5, 25)  # diff = (5 - 15) / 100 = -0.10
    diff, low, high = paired_bootstrap(before, after, seed=0)
    assert diff == pytest.approx(-0.10)
    # sd of the per-item difference: sqrt(0.2 - 0.01); normal half-width 1.96 * sqrt(.19/100)
    half = 1.96 * math.sqrt(0.19 / 100)
    assert low == pytest.approx(-0.10 - half, abs=0.015)
    assert high == pytest.approx(-0.10 + half, abs=0.015)
    assert paired_bootstrap(before, after, seed=0) == (diff, low, high)  # seeded
    assert paired_bootstrap(before, after, seed=1) != (diff, low, high)


def test_bootstrap_matches_index_resampling():
    rng = np.random.default_rng(3)
    before = (rng.random(40) < 0.6).astype(float)
    after = np.where(rng.random(40) < 0.2, 1 - before, before)
    d = after - before
    idx = rng.integers(0, d.size, size=(20000, d.size))
    reference = d[idx].mean(axis=1)
    _, low, high = paired_bootstrap(before, after, resamples=20000, seed=5)
    ref_low, ref_high = np.quantile(reference, [0.025, 0.975])
    assert low == pytest.approx(ref_low, abs=0.026) and high == pytest.approx(ref_high, abs=0.026)


def test_bootstrap_of_identical_runs_is_zero():
    assert paired_bootstrap([1, 0, 1], [1, 0, 1]) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError):
        paired_bootstrap([], [])


def test_paired_comparison_record():
    before, after = _pairs(80, 10, 2, 8)
    r = paired_comparison(before, after)
    assert r.n == 100 and r.before == 0.90 and r.after == 0.82
    assert r.table == PairedTable(80, 10, 2, 8)
    assert r.p_value == pytest.approx(158 / 4096) and r.significant() and not r.significant(0.01)
    assert r.drop_points == pytest.approx(8.0)
    assert r.diff == pytest.approx(-0.08) and r.diff_ci[0] < -0.08 < r.diff_ci[1]
    assert r.before_ci == wilson_interval(90, 100) and r.after_ci == wilson_interval(82, 100)
    assert paired_comparison(before, after, mid_p=True).p_value == pytest.approx(92 / 4096)
