"""The verdict rules (qkgeom.stats.rules) against independent references, and their null
rates pinned with fixed seeds (qkgeom.stats.calibration): a rule that regresses to saying
"holds" on noise fails here. The full calibration is benchmarks/calibration.py."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import stats as ss

from qkgeom.stats import calibration as C
from qkgeom.stats import rules as R


def _rate(fn, reps: int, seed: int = 1) -> float:
    rng = np.random.default_rng(seed)
    return sum(bool(fn(rng)) for _ in range(reps)) / reps


# --------------------------------------------------------------------------- references


def test_sign_flip_p_equals_brute_force_enumeration():
    rng = np.random.default_rng(0)
    for n in (3, 5, 7):
        d = rng.normal(0.3, 1, n)
        obs = d.sum()
        tot = [sum(s * abs(x) for s, x in zip(signs, d))
               for signs in itertools.product([1, -1], repeat=n)]
        want = sum(t >= obs - 1e-12 for t in tot) / 2**n
        assert R.sign_flip_p(d, 1) == pytest.approx(want)
        # the predicted sign -1 mirrors the data
        assert R.sign_flip_p(-d, -1) == pytest.approx(want)
    assert R.sign_flip_p([0.2, 0.5, 0.1, 0.9, 0.3], 1) == 1 / 32


def test_sign_flip_null_size_is_at_most_alpha_exactly():
    """Under sign symmetry, P(p <= a) <= a: enumerate every sign pattern of fixed |d|."""
    a = np.array([0.3, 1.1, 0.7, 2.0, 0.4, 1.6])
    ps = [R.sign_flip_p(np.array(s) * a, 1) for s in itertools.product([1, -1], repeat=6)]
    assert np.mean(np.array(ps) <= 0.05) <= 0.05


def test_holm_by_hand():
    assert R.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert R.holm([0.5]) == [0.5]
    assert R.min_seeds(3) == 6 and R.min_seeds(1) == 5


def test_arm_family_needs_six_seeds_for_three_arms():
    signs = {"shrink": -1, "hold": 1, "shrink_act": -1}
    five = {a: np.full(5, 2.0 * s) for a, s in signs.items()}
    assert {v["verdict"] for v in R.arm_family_rule(five, signs).values()} == {R.NO_DATA}
    six = {a: np.arange(1, 7) * s for a, s in signs.items()}
    fam = R.arm_family_rule(six, signs)
    assert all(v["verdict"] == R.HOLDS and v["p"] == 1 / 64 for v in fam.values())
    six["hold"] = -six["hold"]  # the wrong direction
    assert R.arm_family_rule(six, signs)["hold"]["verdict"] == R.FAILS


def test_within_stratum_spearman_equals_scipy_for_one_stratum():
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(9, 1)), rng.normal(size=(9, 1))
    r = R.trial_permutation_p([x], [y], rng=rng, n_perm=99)
    assert r.rho == pytest.approx(ss.spearmanr(x[:, 0], y[:, 0]).statistic)


def test_within_stratum_spearman_removes_a_shared_trend():
    """Both metrics fall over steps: the pooled Spearman is large, the stratified one is the
    across-trial correlation at each step (here 0 in expectation)."""
    rng = np.random.default_rng(3)
    trend = np.linspace(5, 0, 12)[None, :]
    x = trend + rng.normal(size=(8, 12))
    y = trend + rng.normal(size=(8, 12))
    assert ss.spearmanr(x.ravel(), y.ravel()).statistic > 0.7
    r = R.trial_permutation_p([x], [y], rng=rng)
    num = sum(ss.spearmanr(x[:, j], y[:, j]).statistic for j in range(12)) / 12
    assert r.rho == pytest.approx(num, abs=1e-12)  # equal strata sizes: the mean rho
    assert r.p_value > 0.05


def test_trial_permutation_p_matches_exact_enumeration():
    rng = np.random.default_rng(4)
    x, y = rng.normal(size=(5, 3)), rng.normal(size=(5, 3))
    obs = R.trial_permutation_p([x], [y], rng=rng, n_perm=20_000)
    rx, ry = ss.rankdata(x, axis=0), ss.rankdata(y, axis=0)
    rx, ry = rx - rx.mean(0), ry - ry.mean(0)
    den = math.sqrt((rx**2).sum() * (ry**2).sum())
    stats_ = [(rx * ry[list(p)]).sum() / den for p in itertools.permutations(range(5))]
    exact = np.mean(np.array(stats_) >= obs.rho - 1e-12)
    assert obs.p_value == pytest.approx(exact, abs=0.01)


def test_split_trend_halves_and_known_cases():
    rng = np.random.default_rng(5)
    v = np.array([0.0, 1, 2, 3, 4, 3, 2, 1, 0])
    r = R.split_trend(np.arange(9), v, rng=rng)
    assert r.rho_early == pytest.approx(ss.spearmanr(np.arange(5), v[:5]).statistic)
    assert r.rho_late == pytest.approx(ss.spearmanr(np.arange(5), v[4:]).statistic)
    assert r.rises_then_decays and r.p_value < 0.01
    up = R.split_trend(np.arange(9), np.arange(9.0), rng=rng)
    assert not up.rises_then_decays
    assert not R.split_trend(np.arange(4), [0, 1, 1, 0], rng=rng).rises_then_decays


def test_several_rule_binomial_tail():
    assert R.binom_tail(2, 3, 0.05) == pytest.approx(ss.binom.sf(1, 3, 0.05))
    assert R.several_rule(2, 3) == R.HOLDS
    assert R.several_rule(1, 3) == R.FAILS
    assert R.several_rule(1, 1) == R.NO_DATA
    # with many models two by chance is no longer unlikely enough
    assert ss.binom.sf(1, 10, 0.05) > 0.05 and R.several_rule(2, 10) == R.FAILS


def test_stratified_link_one_checkpoint_is_spearman():
    rng = np.random.default_rng(6)
    x, y = rng.normal(size=12), rng.normal(size=12)
    r = R.stratified_link(x, y, np.zeros(12), rng=rng, n_boot=200)
    assert r.rho == pytest.approx(ss.spearmanr(x, y).statistic)
    assert not r.holds  # one checkpoint is too few


def test_gap_and_slopes_rules():
    assert R.gap_rule(np.ones(27)) == R.HOLDS
    assert R.gap_rule(np.r_[np.ones(26), -1]) == R.FAILS
    assert R.gap_rule(np.ones(3)) == R.NO_DATA  # p = 1/8
    assert R.slopes_rule(np.ones(20), -np.ones(20)) == R.HOLDS
    assert R.slopes_rule(np.ones(20), np.ones(20)) == R.FAILS


# --------------------------------------------------------------------------- null rates


def test_claim2_rules_null_rates():
    for drift in (False, True):
        rates = {}
        rng = np.random.default_rng(7)
        for _ in range(150):
            for k, v in C.claim2_verdicts(*C.trajectories(rng, drift=drift)).items():
                rates[k] = rates.get(k, 0) + (v == R.HOLDS) / 150
        assert rates["2-gap"] <= 0.05 and rates["2-slopes"] <= 0.05
        assert rates["2-slopes-late"] <= 0.05


def test_late_window_is_unbiased_where_the_argmin_window_is_not():
    """Flat noisy trajectories: after a per-trajectory argmin the PR_Q slope is positive
    far more than half the time; after the fixed cut it is not."""
    rng = np.random.default_rng(8)
    flat = np.full(C.PROGRESS.size, 3.0)
    after_min, after_cut = [], []
    cut = int(np.searchsorted(C.PROGRESS, R.LATE_FROM - 1e-12))
    for _ in range(400):
        q = flat + C._ar1(rng, (C.PROGRESS.size,))
        k = flat + C._ar1(rng, (C.PROGRESS.size,))
        i = C.collapse_index(C.PROGRESS, q + k)
        after_min.append(np.polyfit(C.PROGRESS[i:], q[i:], 1)[0] > 0)
        after_cut.append(np.polyfit(C.PROGRESS[cut:], q[cut:], 1)[0] > 0)
    assert np.mean(after_min) > 0.58
    assert 0.42 < np.mean(after_cut) < 0.58


def test_claim3_null_rate_and_the_retired_rule():
    assert _rate(lambda g: C.claim3_verdict(g) == R.HOLDS, 80) <= 0.05
    assert _rate(lambda g: C.claim3_verdict(g, 0.9, 0.0) == R.HOLDS, 80) <= 0.1
    assert _rate(C.claim3_retired, 10) >= 0.8  # the pooled rule: the trend makes it


def test_claim4_null_rates():
    for n in (6, 8):
        assert _rate(lambda g, n=n: R.HOLDS in C.claim4_verdicts(C.arm_deltas(g, n)).values(),
                     600) <= 0.06
    assert _rate(lambda g: R.HOLDS in C.claim4_verdicts(C.arm_deltas(g, 5)).values(),
                 100) == 0.0
    # the retired rule (directional confidence >= 0.95) exceeds 5% on the same null
    assert _rate(lambda g: C.claim4_retired(g, C.arm_deltas(g, 5))["shrink"] == R.HOLDS,
                 300) > 0.07


def test_claim5_null_rates_and_the_retired_rule():
    for n in (5, 10, 20):
        assert _rate(lambda g, n=n: C.claim5_trend(g, n, n_perm=199)[1][0], 150) <= 0.08
        assert _rate(lambda g, n=n: R.several_rule(C.claim5_trend(g, n, n_perm=199)[0],
                                                   C.MODELS) == R.HOLDS, 60) <= 0.05
    assert _rate(lambda g: C.claim5_retired(g, 10), 200) > 0.5
    assert _rate(lambda g: C.link_holds(g, 10, n_boot=100), 150) <= 0.08


def test_rule_error_reads_the_record():
    rec = {"commit": "abc", "date": "2026-12-04", "reps": 10, "rows": [
        {"rule": "4-shrink", "scenario": "paired-null, 6 seeds", "kind": "null",
         "effect": "-", "rate": 0.02, "ci_high": 0.04},
        {"rule": "4-shrink", "scenario": "paired, 6 seeds, shrink effect 1.0 sd",
         "kind": "power", "effect": "1.0 sd", "rate": 0.9, "ci_high": 0.95}]}
    line = C.rule_error("4-hold", rec, n_seeds=6)
    assert "false holds <= 2.0%" in line and "90.0% at 1.0 sd" in line
    assert "needs 6 seeds" in line
    assert "not calibrated at 5 seeds" in C.rule_error("4-hold", rec, n_seeds=5)


def test_the_report_header_names_rules_over_the_limits_and_the_largest_estimate():
    from qkgeom.report.claims import calibration_header

    row = dict(kind="null", effect="-", reps=1000, holds=0)
    rec = {"commit": "a" * 40, "date": "2026-12-04", "reps": 2000, "rows": [
        dict(row, rule="2-gap", scenario="flat", rate=0.01, ci_low=0.005, ci_high=0.02),
        dict(row, rule="5-link", scenario="30", rate=0.052, ci_low=0.045, ci_high=0.059),
        dict(row, rule="3 (retired)", scenario="trend", rate=1.0, ci_low=0.96, ci_high=1.0)]}
    h = calibration_header(rec)
    assert "no rule's false-holds rate is shown to exceed 5%" in h
    assert "5-link, 30, 5.2% [4.5%, 5.9%]" in h and "retired" not in h
    rec["rows"].append(dict(row, rule="4-hold", scenario="5 seeds", rate=0.09, ci_low=0.07,
                            ci_high=0.11))
    h = calibration_header(rec)
    assert "rules over the limits" in h and "4-hold (5 seeds, 9.0%)" in h
    assert "5-link" not in h  # within its interval: not over
    assert "not recorded" in calibration_header(None)
