"""The pure statistics against scipy and against hand computations on tiny cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats as ss

from qkgeom import stats as S
from qkgeom.stats import rank_correlation as RC

# --------------------------------------------------------------------------- sign test


def test_sign_test_five_positive_is_one_over_32():
    r = S.sign_test([0.1, 0.2, 0.3, 0.4, 0.5])
    assert (r.n, r.n_positive, r.n_negative) == (5, 5, 0)
    assert r.p_value == 1 / 32


def test_sign_test_hand_cases():
    # 4 of 5 positive: P(X >= 4) = (5 + 1) / 32
    assert S.sign_test([1, 1, 1, 1, -1]).p_value == 6 / 32
    # all negative: P(X >= 0) = 1
    assert S.sign_test([-1, -2, -3]).p_value == 1.0
    # 54 of 54: the paper's 2^-54
    assert S.sign_test(np.ones(54)).p_value == 2.0**-54


def test_sign_test_zeros_and_nonfinite_are_excluded_and_counted():
    r = S.sign_test([1.0, 0.0, 2.0, math.nan, math.inf, -0.5])
    assert (r.n, r.n_positive, r.n_negative, r.n_zero, r.n_dropped) == (3, 2, 1, 1, 2)
    assert r.p_value == 4 / 8


def test_sign_test_predicted_negative():
    r = S.sign_test([-1, -2, -3, 4], predicted_sign=-1)
    assert r.n_positive == 3
    assert r.p_value == 5 / 16


def test_sign_test_empty():
    r = S.sign_test([])
    assert r.n == 0 and r.p_value == 1.0


@pytest.mark.parametrize("n", [1, 2, 5, 13, 36, 54, 200])
def test_sign_test_matches_binomtest(n):
    rng = np.random.default_rng(n)
    for _ in range(5):
        d = rng.normal(0.2, 1, n)
        r = S.sign_test(d)
        ref = ss.binomtest(int((d > 0).sum()), n, 0.5, alternative="greater").pvalue
        assert abs(r.p_value - ref) <= 1e-12 * max(1.0, ref)
        assert r.to_dict()["n"] == n


def test_sign_test_rejects_bad_sign():
    with pytest.raises(ValueError):
        S.sign_test([1], predicted_sign=0)


# --------------------------------------------------------------------------- slopes


def test_slopes_exact_lines_and_summary():
    p = [np.linspace(0, 1, 11)] * 3
    v = [2 + 0.14 * p[0], 5 - 0.04 * p[0], 1 + 0 * p[0]]
    r = S.slopes(p, v)
    assert np.allclose(r.slopes, [0.14, -0.04, 0.0], atol=1e-12)
    assert np.allclose(r.intercepts, [2, 5, 1])
    assert r.n == 3 and r.n_positive == 1
    assert r.mean == pytest.approx(0.1 / 3)
    assert r.median == pytest.approx(0.0, abs=1e-12)
    assert r.share_positive == pytest.approx(1 / 3)


def test_slopes_match_linregress_and_ragged():
    rng = np.random.default_rng(0)
    ps = [np.sort(rng.uniform(0, 1, k)) for k in (5, 9, 30)]
    vs = [rng.normal(size=len(p)) + 0.3 * p for p in ps]
    r = S.slopes(ps, vs)
    for b, p, v in zip(r.slopes, ps, vs):
        assert abs(b - ss.linregress(p, v).slope) < 1e-12
    assert r.sd == pytest.approx(np.std(r.slopes, ddof=1))


def test_slopes_undefined_trajectory():
    r = S.slopes([[0.5], [0, 1]], [[3.0], [0, 2]])
    assert math.isnan(r.slopes[0]) and r.slopes[1] == 2
    assert r.n == 1 and r.n_undefined == 1 and math.isnan(r.sd)


# --------------------------------------------------------------------------- bootstrap


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("n", [5, 8, 20])
def test_directional_matches_scipy_bootstrap(seed, n):
    d = np.random.default_rng(100 + seed).normal(-0.2, 0.3, n)
    r = S.directional_confidence(d, predicted_sign=-1, rng=np.random.default_rng(seed))
    for method, lo, hi in (("BCa", r.ci_low, r.ci_high), ("percentile", r.pct_low, r.pct_high)):
        ref = ss.bootstrap((d,), np.mean, n_resamples=10_000, method=method,
                           rng=np.random.default_rng(seed)).confidence_interval
        assert abs(lo - ref.low) < 1e-12 and abs(hi - ref.high) < 1e-12, method
    ref = ss.bootstrap((d,), np.mean, n_resamples=10_000, method="BCa",
                       rng=np.random.default_rng(seed))
    np.testing.assert_array_equal(r.boot_means, ref.bootstrap_distribution)
    assert abs(r.boot_se - ref.standard_error) < 1e-12
    dc = (np.asarray(ref.bootstrap_distribution) < 0).mean()
    assert r.directional_confidence == dc


def test_bca_acceleration_by_hand():
    x = np.array([1.0, 2.0, 4.0, 8.0])
    jack = np.array([(x.sum() - xi) / 3 for xi in x])
    u = 3 * (jack.mean() - jack)
    a_hand = (u**3).sum() / 4**3 / (6 * ((u**2).sum() / 4**2) ** 1.5)
    boot = S.bootstrap_means(x, 10_000, np.random.default_rng(0))
    *_, a = S.bca_interval(x, boot)
    assert a == pytest.approx(a_hand, abs=1e-14)


def test_directional_all_positive_five_seeds():
    d = [0.31, 0.25, 0.4, 0.28, 0.33]
    r = S.directional_confidence(d, predicted_sign=1, rng=np.random.default_rng(7))
    assert r.n_seeds == 5 and r.n_agree == 5
    assert r.sign_test_p == 1 / 32
    assert r.directional_confidence == 1.0
    assert r.mean_delta == pytest.approx(np.mean(d))
    assert 0.25 <= r.ci_low < r.mean_delta < r.ci_high <= 0.4
    # the wrong prediction gets zero confidence and p = 1
    w = S.directional_confidence(d, predicted_sign=-1, rng=np.random.default_rng(7))
    assert w.directional_confidence == 0.0 and w.sign_test_p == 1.0


def test_directional_is_reproducible_and_seed_sensitive():
    d = np.random.default_rng(3).normal(0.1, 0.3, 5)
    a = S.directional_confidence(d, predicted_sign=1, rng=np.random.default_rng(9)).to_dict()
    b = S.directional_confidence(d, predicted_sign=1, rng=np.random.default_rng(9)).to_dict()
    c = S.directional_confidence(d, predicted_sign=1, rng=np.random.default_rng(10)).to_dict()
    assert a == b
    assert a["boot_se"] != c["boot_se"]  # (5-seed quantiles often coincide)
    assert "boot_means" not in a


def test_directional_degenerate_and_invalid():
    r = S.directional_confidence([0.2, 0.2, 0.2], predicted_sign=1,
                                 rng=np.random.default_rng(0))
    assert r.ci_low == r.ci_high == pytest.approx(0.2)
    assert r.directional_confidence == 1.0
    with pytest.raises(ValueError, match="n_boot"):
        S.directional_confidence([1, 2], predicted_sign=1, rng=np.random.default_rng(0),
                                 n_boot=999)
    with pytest.raises(ValueError, match="at least 2"):
        S.directional_confidence([1, math.nan], predicted_sign=1,
                                 rng=np.random.default_rng(0))


# --------------------------------------------------------------------------- Spearman


@pytest.mark.parametrize("ties", [False, True])
def test_spearman_matches_scipy(ties):
    rng = np.random.default_rng(1)
    for n in (3, 10, 257):
        x = rng.integers(0, 4, n).astype(float) if ties else rng.normal(size=n)
        y = x + rng.normal(size=n)
        assert abs(S.spearman(x, y) - ss.spearmanr(x, y).statistic) < 1e-12


@pytest.mark.parametrize("ties", [False, True])
def test_spearman_ci_matches_scipy_paired_bootstrap(ties):
    rng = np.random.default_rng(2)
    n = 40
    x = rng.integers(0, 6, n).astype(float) if ties else rng.normal(size=n)
    y = -x + rng.normal(size=n)
    r = S.spearman_ci(x, y, n_boot=500, rng=np.random.default_rng(11))
    ref = ss.bootstrap((x, y), lambda a, b: ss.spearmanr(a, b).statistic, paired=True,
                       vectorized=False, n_resamples=500, method="percentile",
                       rng=np.random.default_rng(11)).confidence_interval
    assert abs(r.rho - ss.spearmanr(x, y).statistic) < 1e-12
    assert abs(r.ci_low - ref.low) < 1e-12 and abs(r.ci_high - ref.high) < 1e-12


def test_resample_ranks_equal_rankdata():
    rng = np.random.default_rng(4)
    for n in (1, 2, 7, 100):
        x = rng.integers(0, 3, n).astype(float)
        y = rng.normal(size=n)
        order = np.argsort(x, kind="stable")
        rx, ry = RC._WeightedRanks(x[order]), RC._WeightedRanks(y[order])
        pos = np.empty(n, dtype=np.intp)
        pos[order] = np.arange(n)
        for _ in range(5):
            idx = rng.integers(0, n, n)
            w = np.bincount(pos[idx], minlength=n)
            for rk, v in ((rx, x), (ry, y)):
                got = rk(w, n)
                want = ss.rankdata(v[idx])
                # the ranker returns 2 * (rank - mean rank) per original point
                exp = np.zeros(n)
                exp[pos[idx]] = 2 * (want - (n + 1) / 2)
                np.testing.assert_array_equal(got[w > 0], exp[w > 0])


def test_spearman_ci_small_and_nonfinite():
    r = S.spearman_ci([1, 2, math.nan], [1, 2, 3], n_boot=100, rng=np.random.default_rng(0))
    assert r.n == 2 and r.n_dropped == 1 and math.isnan(r.rho)
    r = S.spearman_ci([1, 2, 3, 4], [4, 3, 2, 1], n_boot=200, rng=np.random.default_rng(0))
    assert r.rho == -1.0
    assert r.ci_high == -1.0  # every defined resample is perfectly decreasing
    assert r.n_boot_undefined > 0  # some resamples repeat one point only


def _cluster_reference(x, y, labels, n_boot, seed, ci=0.95):
    """Straightforward cluster bootstrap: pool the drawn clusters' points (each as often as
    its cluster was drawn) and call scipy's spearmanr on the pooled arrays."""
    rng = np.random.default_rng(seed)
    names = np.unique(labels)
    groups = [np.flatnonzero(labels == g) for g in names]
    rhos = []
    for _ in range(n_boot):
        pick = np.concatenate([groups[k] for k in rng.integers(0, names.size, names.size)])
        xs, ys = x[pick], y[pick]
        if np.ptp(xs) == 0 or np.ptp(ys) == 0:
            continue
        rhos.append(ss.spearmanr(xs, ys).statistic)
    return np.quantile(rhos, [(1 - ci) / 2, (1 + ci) / 2]), n_boot - len(rhos)


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("method", ["tensor", "points", "auto"])
def test_cluster_bootstrap_matches_pooled_reference(ties, method):
    rng = np.random.default_rng(5)
    sizes = rng.integers(1, 25, 9)  # unequal clusters, some tiny
    labels = np.repeat(np.array([f"trial-{k}" for k in range(9)]), sizes)
    shift = rng.normal(size=9)[np.repeat(np.arange(9), sizes)]  # a shared offset per cluster
    x = shift + rng.normal(size=labels.size)
    y = shift + 0.5 * x + rng.normal(size=labels.size)
    if ties:
        x, y = np.round(x), np.round(y)
    perm = rng.permutation(labels.size)  # clusters interleaved, not contiguous
    x, y, labels = x[perm], y[perm], labels[perm]
    r = S.spearman_ci(x, y, clusters=labels, n_boot=300, rng=np.random.default_rng(8),
                      method=method)
    (lo, hi), undefined = _cluster_reference(x, y, labels, 300, 8)
    assert r.resample == "clusters" and r.n_clusters == 9 and r.n == labels.size
    assert abs(r.rho - ss.spearmanr(x, y).statistic) < 1e-12
    assert abs(r.ci_low - lo) < 1e-12 and abs(r.ci_high - hi) < 1e-12
    assert r.n_boot_undefined == undefined


def test_cluster_rank_sums_equal_rankdata_per_resample():
    # the O(T^3) identity, one resample at a time against scipy on the pooled points
    rng = np.random.default_rng(6)
    codes = rng.integers(0, 5, 60)
    x = rng.integers(0, 4, 60).astype(float)  # heavy ties
    y = rng.normal(size=60)
    sums = RC._ClusterRankSums(x, y, codes, 5)
    counts = np.array([[1, 1, 1, 1, 1], [0, 2, 0, 3, 0], [5, 0, 0, 0, 0], [0, 0, 1, 1, 3]])
    got = sums.rhos(counts)
    for c, g in zip(counts, got):
        w = c[codes]
        xs, ys = np.repeat(x, w), np.repeat(y, w)
        want = ss.spearmanr(xs, ys).statistic if np.ptp(xs) > 0 else math.nan
        assert (math.isnan(g) and math.isnan(want)) or abs(g - want) < 1e-12


def test_cluster_bootstrap_wider_than_pairs_when_clusters_share_noise():
    # 20 clusters of 50 points; the x-y link lives only in a per-cluster offset, so the
    # effective sample size is 20, not 1000: the pair bootstrap is far too narrow
    rng = np.random.default_rng(7)
    k = np.repeat(np.arange(20), 50)
    off = rng.normal(size=20)[k]
    x = off + 0.3 * rng.normal(size=k.size)
    y = off + 0.3 * rng.normal(size=k.size)
    pairs = S.spearman_ci(x, y, n_boot=400, rng=np.random.default_rng(0))
    clus = S.spearman_ci(x, y, clusters=k, n_boot=400, rng=np.random.default_rng(0))
    assert clus.rho == pairs.rho
    assert (clus.ci_high - clus.ci_low) > 3 * (pairs.ci_high - pairs.ci_low)


def test_cluster_bootstrap_few_clusters_and_nonfinite():
    x = [1.0, 2.0, 3.0, 4.0, math.nan, 6.0]
    y = [2.0, 1.0, 4.0, 3.0, 5.0, math.inf]
    r = S.spearman_ci(x, y, clusters=["a", "a", "b", "b", "c", "c"], n_boot=100,
                      rng=np.random.default_rng(0))
    # pairs 5 and 6 are dropped, which removes cluster c: 2 clusters, no CI
    assert r.n == 4 and r.n_dropped == 2 and r.n_clusters == 2
    assert r.rho == pytest.approx(0.6) and math.isnan(r.ci_low) and math.isnan(r.ci_high)
    with pytest.raises(ValueError, match="labels"):
        S.spearman_ci([1, 2, 3], [1, 2, 3], clusters=[0, 1], rng=np.random.default_rng(0))


# --------------------------------------------------------------------------- checkpoints


def test_checkpoint_trend_rise_then_decay():
    steps = [0, 1000, 2000, 4000, 8000, 16000, 32000]
    vals = [0.0, 1.0, 2.0, 3.0, 2.5, 1.0, 0.5]
    r = S.checkpoint_trend(steps, vals)
    assert r.peak_step == 4000 and r.peak_index == 3
    assert r.rho_early == 1.0 and r.rho_late == -1.0
    assert r.rises_then_decays and r.monotonic_early
    assert abs(r.rho - ss.spearmanr(steps, vals).statistic) < 1e-12


def test_checkpoint_trend_monotonic_and_unsorted_input():
    r = S.checkpoint_trend([3, 1, 2, 0], [3.0, 1.0, 2.0, 0.0])
    assert r.rho == 1.0 and r.peak_step == 3
    assert math.isnan(r.rho_late) and not r.rises_then_decays
    assert r.steps == [0, 1, 2, 3]


def test_checkpoint_trend_edge_cases():
    assert S.checkpoint_trend([], []).n_checkpoints == 0
    r = S.checkpoint_trend([5], [1.0])
    assert r.peak_step == 5 and math.isnan(r.rho)
    with pytest.raises(ValueError, match="duplicate"):
        S.checkpoint_trend([1, 1, 2], [1, 2, 3])
    r = S.checkpoint_trend([0, 1, 2, 3], [1.0, math.nan, 2.0, 3.0])
    assert r.n_checkpoints == 3


def test_avg_ranks_equal_rankdata():
    rng = np.random.default_rng(8)
    for n in (1, 2, 5, 100, 1001):
        for a in (rng.normal(size=n), rng.integers(0, 4, n).astype(float)):
            np.testing.assert_array_equal(RC._avg_ranks(a), ss.rankdata(a))


def test_resample_ranks_sum_of_squares_and_rho_equal_scipy():
    """``ranks_ss`` and ``_resample_spearman`` against scipy on the explicit resample."""
    rng = np.random.default_rng(7)
    for n in (2, 5, 60, 301):
        for ties in (False, True):
            x = rng.integers(0, 4, n).astype(float) if ties else rng.normal(size=n)
            y = rng.integers(0, 3, n).astype(float) + 0.5 * x
            order = np.argsort(x, kind="stable")
            rx, ry = RC._WeightedRanks(x[order]), RC._WeightedRanks(y[order])
            pos = np.empty(n, dtype=np.intp)
            pos[order] = np.arange(n)
            for _ in range(4):
                idx = rng.integers(0, n, n)
                w = np.bincount(pos[idx], minlength=n)
                for rk, v in ((rx, x), (ry, y)):
                    r, ss_ = rk.ranks_ss(w, n)
                    want = 2 * (ss.rankdata(v[idx]) - (n + 1) / 2)
                    assert ss_ == int(round((want**2).sum()))
                    np.testing.assert_array_equal(r[pos[idx]], want)
                got = RC._resample_spearman(w, rx, ry, np.empty(n, dtype=np.int64))
                xs, ys = x[idx], y[idx]
                if np.ptp(xs) == 0 or np.ptp(ys) == 0:
                    assert math.isnan(got)
                else:
                    assert abs(got - ss.spearmanr(xs, ys).statistic) < 1e-12


def test_cluster_path_choice():
    # the benchmark's shape takes the O(T^3) path; many clusters or few points per
    # cluster, or a build too large for memory, take the per-point path
    assert RC._use_tensor(111_848, 44)
    assert not RC._use_tensor(200, 40)  # 40^3 > 16 * 200
    assert not RC._use_tensor(10**7, 193)  # more than 192 clusters
    assert not RC._use_tensor(10**6, 100)  # n * T = 10^8 table entries


# --------------------------------------------------------------------------- collapse point


def test_collapse_index_known_cases():
    from qkgeom.stats import collapse_index

    p = np.linspace(0, 1, 11)
    total = np.array([34, 20, 6, 5, 7, 8, 9, 10, 1, 12, 13], dtype=float)
    # the lowest total in the first half is at index 3; the later 1 (progress 0.8) is not
    # the initial collapse
    assert collapse_index(p, total) == 3
    assert collapse_index(p, total, search=0.9) == 8
    tie = np.array([9, 4, 4, 6, 7, 8, 9, 9, 9, 9, 9], dtype=float)
    assert collapse_index(p, tie) == 1  # the earliest of equal minima
    nan = total.copy()
    nan[3] = np.nan
    assert collapse_index(p, nan) == 2  # non-finite probes are ignored
    assert collapse_index(p, np.full(11, np.nan)) == -1
    # a trajectory that never collapses (monotone rise) collapses at step 0
    assert collapse_index(p, np.arange(11.0)) == 0
    with pytest.raises(ValueError):
        collapse_index(p, total[:3])
