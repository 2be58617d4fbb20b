"""The verdict rules: pure functions from the measured arrays to ``holds`` / ``not shown``
/ ``contradicted`` / ``not enough data``, each with an error rate that :mod:`qkgeom.stats.calibration`
measures under null models and ``benchmarks/calibration.py`` records.

:mod:`qkgeom.report.claims` reads the database and calls these; the calibration calls the same
functions on simulated data, so what is calibrated is what decides the report.

* :func:`seed_gap_rule` (claim 2-gap) and :func:`seed_slopes_rule` (2-slopes, from step 0
  and from the pre-specified progress :data:`LATE_FROM`): the seed is the unit
  (:func:`seed_means`), since every layer, depth and init of a seed shares its data order
  and initial draw. :func:`gap_rule` and :func:`slopes_rule` (trajectories as units) are
  retired, kept for the calibration's comparison.
* :func:`stratified_spearman` and :func:`trial_permutation_p` (claim 3: the correlation
  across trials at the same training progress (:func:`align_by_loss`), depth and layer,
  so a shared training-time trend, a trial's training speed or a
  layer effect cannot make it).
* :func:`sign_flip_p`, :func:`holm` and :func:`arm_family_rule` (claim 4: an exact
  sign-flip permutation test per arm, Holm's step-down over the arms sharing a baseline).
* :func:`all_lower_rule` (reality checks).
* :func:`split_trend`, :func:`stratified_link` and :func:`several_rule` (claim 5:
  pre-specified halves of the checkpoint series tested against exchangeable increments;
  the link with whole layers permuted across checkpoints; "several" = at least two models
  at level 2 alpha / models, valid however the models depend on each other).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from qkgeom.stats.common import ResultDict, binom_tail_half, finite_values
from qkgeom.stats.effects import sign_test

# The verdict words. "holds": the test rejects its null at ALPHA in the claim's direction;
# "contradicted": a calibrated test rejects it in the opposite direction; "not shown":
# neither (the report gives the power the design had); "not enough data": the design
# cannot reach ALPHA at all (its smallest attainable p is above it) or the data are missing.
HOLDS, NOT_SHOWN, CONTRADICTED, NO_DATA = ("holds", "not shown", "contradicted",
                                           "not enough data")
DECIDED = (HOLDS, NOT_SHOWN, CONTRADICTED)
ALPHA = 0.05
# Claim 2's second trend window starts at a progress fixed before any data are seen: after
# the warm-up (4% of training) and the paper's initial collapse (about step 100 of 1,500,
# progress 0.07), with three quarters of training left to fit. It is not chosen per
# trajectory from the values it tests (a per-trajectory minimum biases every later slope
# upward; docs/statistics.md, "Calibration").
LATE_FROM = 0.25
N_PERM = 9_999  # Monte Carlo permutations (p = (1 + #{T* >= T}) / (1 + N_PERM))
EXACT_FLIPS = 16  # sign-flip tests enumerate all 2^n sign vectors up to this n


# --------------------------------------------------------------------------- claim 2


def gap_rule(final_gaps: Any, alpha: float = ALPHA) -> str:
    """Claim 2-gap: PR_Q - PR_K > 0 at the final probe in every trajectory, with the
    one-sided sign test below ``alpha``; does not hold if any trajectory is <= 0."""
    d, _ = finite_values(final_gaps)
    if d.size == 0:
        return NO_DATA
    if not (d > 0).all():
        return NOT_SHOWN
    return HOLDS if sign_test(d).p_value < alpha else NO_DATA


def slopes_rule(q_slopes: Any, k_slopes: Any, alpha: float = ALPHA) -> str:
    """Claim 2-slopes: PR_Q slopes positive and PR_K slopes negative, each in a majority
    significant by the one-sided sign test (an intersection-union test: its error rate is
    at most ``alpha`` under every null)."""
    q = sign_test(q_slopes)
    k = sign_test(k_slopes, predicted_sign=-1)
    if q.n == 0:
        return NO_DATA
    if q.p_value < alpha and k.p_value < alpha:
        return HOLDS
    return NO_DATA if q.n < 5 else NOT_SHOWN


def seed_means(values: Any, seeds: Any) -> np.ndarray:
    """The mean of ``values`` per seed (non-finite values dropped), in seed order: the
    unit of analysis of claim 2. Every layer, depth and init of one seed shares its data
    order and its initial draw, so only whole seeds are independent."""
    v = np.asarray(values, dtype=float).ravel()
    s = np.asarray(seeds).ravel()
    keep = np.isfinite(v)
    v, s = v[keep], s[keep]
    return np.array([v[s == u].mean() for u in np.unique(s)])


def seed_gap_rule(trajectory_gaps: Any, seed_gaps: Any, alpha: float = ALPHA) -> str:
    """Claim 2-gap with the seed as its unit: PR_Q - PR_K > 0 at the final probe in every
    trajectory (the paper's 'all 54'; it cannot hold if any is <= 0) and, over seeds (each
    seed's mean final gap over its trials and layers), the one-sided sign test below
    ``alpha``; contradicted when the seeds' sign test in the opposite direction (mean gap
    negative) is below ``alpha``. With too few seeds for 2^-n < ``alpha`` (fewer than 5):
    not enough data.
    Under a null where seeds are independent with median gap <= 0 its error rate is at
    most ``alpha`` whatever the layers, depths and inits of a seed share."""
    d, _ = finite_values(trajectory_gaps)
    s, _ = finite_values(seed_gaps)
    if d.size == 0 or s.size == 0:
        return NO_DATA
    if 2.0 ** -s.size >= alpha:
        return NO_DATA
    if (d > 0).all() and sign_test(s).p_value < alpha:
        return HOLDS
    if sign_test(s, predicted_sign=-1).p_value < alpha:
        return CONTRADICTED
    return NOT_SHOWN


def seed_slopes_rule(q_seed_slopes: Any, k_seed_slopes: Any, alpha: float = ALPHA) -> str:
    """Claim 2-slopes with the seed as its unit: each seed's mean PR_Q slope (over its
    trials and layers) positive and its mean PR_K slope negative, one-sided sign tests
    over seeds each below ``alpha`` (an intersection-union test). Contradicted when either
    half's sign test in the opposite direction is below ``alpha`` / 2 (Bonferroni over the
    two). Fewer than 5 seeds: not enough data (2^-n cannot reach ``alpha``)."""
    q = sign_test(q_seed_slopes)
    k = sign_test(k_seed_slopes, predicted_sign=-1)
    if q.n == 0 or 2.0 ** -q.n >= alpha:
        return NO_DATA
    if q.p_value < alpha and k.p_value < alpha:
        return HOLDS
    opposite = min(sign_test(q_seed_slopes, predicted_sign=-1).p_value,
                   sign_test(k_seed_slopes).p_value)
    return CONTRADICTED if opposite < alpha / 2 else NOT_SHOWN


# --------------------------------------------------------------------------- claim 3


def _centred_ranks(a: np.ndarray) -> np.ndarray:
    """Average ranks along axis 0, centred (ties share their mean rank)."""
    from scipy.stats import rankdata

    r = rankdata(a, axis=0)
    return r - r.mean(axis=0, keepdims=True)


@dataclass
class StratifiedCorrelation(ResultDict):
    """Spearman across trials within strata (same step or progress level, depth and layer),
    pooled.

    ``rho`` = sum of within-stratum products of centred ranks over the square root of the
    product of their sums of squares; ``p_value`` is one-sided (predicted > 0) from
    ``n_perm`` permutations of whole trials within their depth; ``n_trials`` and
    ``n_strata`` say what it rests on.
    """

    rho: float
    p_value: float
    n_trials: int
    n_strata: int
    n_perm: int
    min_p: float = 1.0  # the smallest p the design allows: 1 / prod(n_trials_g!)
    p_opposite: float = 1.0  # one-sided p in the opposite direction (predicted < 0)


def _group_grams(x_groups: list[np.ndarray], y_groups: list[np.ndarray]
                 ) -> tuple[list[np.ndarray], float]:
    grams, sx, sy = [], 0.0, 0.0
    for x, y in zip(x_groups, y_groups):
        rx = _centred_ranks(x).reshape(x.shape[0], -1)
        ry = _centred_ranks(y).reshape(y.shape[0], -1)
        grams.append(rx @ ry.T)  # [t, u] = <ranks of trial t's x, ranks of trial u's y>
        sx += float((rx**2).sum())
        sy += float((ry**2).sum())
    return grams, math.sqrt(sx * sy)


def trial_permutation_p(x_groups: list[np.ndarray], y_groups: list[np.ndarray], *,
                        rng: np.random.Generator, n_perm: int = N_PERM
                        ) -> StratifiedCorrelation:
    """Within-stratum Spearman of x and y and its permutation p-value.

    ``x_groups[g]`` and ``y_groups[g]`` are arrays ``(n_trials_g, n_strata_g)`` (one group
    per depth; a column is a (step, layer) stratum, complete in every trial of the group).
    Under the null that trials are exchangeable (x of one trial tells nothing about y of
    another), permuting whole trials' y within a group leaves the statistic's distribution
    unchanged, whatever the within-trial dependence over steps and layers. Ranks along the
    trial axis commute with the permutation, so each permutation costs one sum over a
    precomputed trials x trials matrix.
    """
    keep = [(x, y) for x, y in zip(x_groups, y_groups) if x.shape[0] >= 2 and x.size]
    if not keep:
        return StratifiedCorrelation(math.nan, 1.0, 0, 0, 0)
    grams, den = _group_grams([k[0] for k in keep], [k[1] for k in keep])
    n_trials = sum(g.shape[0] for g in grams)
    n_strata = sum(k[0].shape[1] for k in keep)
    orders = math.prod(math.factorial(g.shape[0]) for g in grams)
    if den == 0:  # no metric varies across trials: no correlation to test
        return StratifiedCorrelation(math.nan, 1.0, n_trials, n_strata, 0, 1.0 / orders)
    obs = sum(float(np.trace(g)) for g in grams) / den
    perm = np.zeros(n_perm)
    for g in grams:
        n = g.shape[0]
        idx = rng.permuted(np.tile(np.arange(n), (n_perm, 1)), axis=1)
        perm += g[np.arange(n)[None, :], idx].sum(axis=1)
    perm /= den
    p = (1 + int((perm >= obs - 1e-12).sum())) / (1 + n_perm)
    p_neg = (1 + int((perm <= obs + 1e-12).sum())) / (1 + n_perm)
    return StratifiedCorrelation(obs, p, n_trials, n_strata, n_perm, 1.0 / orders, p_neg)


def align_by_loss(x: np.ndarray, y: np.ndarray, loss: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray] | None:
    """Two metrics of a group of trials re-indexed by training progress instead of step.

    ``x`` and ``y`` are ``(trials, steps, layers)``, ``loss`` ``(trials, steps)``, steps
    in order. A trial's progress at a probe is the best validation loss it has reached
    so far (the running minimum, NaN skipped); each metric is interpolated linearly
    against it at ``steps`` levels spaced evenly over the range every trial of the group
    passes through. A trial that trains faster is further along at the same step in
    every metric at once, so at the same step its PR_K and its entropy are both lower
    whether or not they are linked; at the same loss reached they are compared at the
    same point of training. Returns ``(trials, levels * layers)`` arrays, or None when
    the trials' ranges do not overlap (or a trial has no finite loss); trials whose
    losses are equal at every step are already aligned (returned as they are).
    """
    n, s = loss.shape
    if np.isfinite(loss).all() and np.allclose(loss, loss[:1], rtol=0, atol=1e-12):
        return x.reshape(n, -1), y.reshape(n, -1)  # the same loss at every step: no shift
    best = np.fmin.accumulate(np.where(np.isfinite(loss), loss, np.inf), axis=1)
    if not np.isfinite(best[:, -1]).all():
        return None
    lo = float(best[:, -1].max())
    first = np.where(np.isfinite(best), best, -np.inf).max(axis=1)  # the first finite
    hi = float(first.min())
    if not hi > lo:
        return None
    levels = np.linspace(lo, hi, s)
    out = []
    for a in (x, y):
        al = np.empty((n, s, a.shape[2]))
        for t in range(n):
            ok = np.isfinite(best[t])
            # the first probe at which each level was reached (np.unique keeps the first)
            vals, idx = np.unique(best[t][ok], return_index=True)
            rows = a[t][ok][idx]
            for la in range(a.shape[2]):
                al[t, :, la] = np.interp(levels, vals, rows[:, la])
        out.append(al[:, ::-1].reshape(n, -1))  # from the highest loss (earliest) down
    return out[0], out[1]


def both_rule(p_values: list[float], alpha: float = ALPHA,
              p_opposite: list[float] | None = None) -> str:
    """Claim 3 needs every one of its correlations: an intersection-union test, each at
    ``alpha`` (error rate at most ``alpha`` under every null). Contradicted when one of
    them is significant in the opposite direction (``p_opposite``, each at ``alpha`` / k,
    Bonferroni over the k correlations)."""
    if not p_values or any(p is None or not math.isfinite(p) for p in p_values):
        return NO_DATA
    if max(p_values) < alpha:
        return HOLDS
    if p_opposite and min(p_opposite) < alpha / len(p_opposite):
        return CONTRADICTED
    return NOT_SHOWN


# --------------------------------------------------------------------------- claim 4


def sign_flip_p(deltas: Any, predicted_sign: int, *, rng: np.random.Generator | None = None
                ) -> float:
    """One-sided p-value of the paired mean by sign-flip permutation: the share of the 2^n
    sign vectors whose mean (times ``predicted_sign``) is at least the observed one.

    Exact for n <= :data:`EXACT_FLIPS` (all vectors); above, 2^16 random vectors plus the
    observed one. Under sign-symmetric deltas (no effect) ``P(p <= a) <= a`` exactly; with
    5 seeds the smallest p is 1/32.
    """
    d, _ = finite_values(deltas)
    n = d.size
    if n == 0:
        return 1.0
    a = np.abs(d)
    obs = float((d * predicted_sign).sum())
    if n <= EXACT_FLIPS:
        signs = 1 - 2 * ((np.arange(2**n)[:, None] >> np.arange(n)[None, :]) & 1)
        tot = signs @ a
        return float((tot >= obs - 1e-12 * max(1.0, a.sum())).mean())
    rng = rng or np.random.default_rng(0)
    signs = rng.choice([-1.0, 1.0], size=(2**16, n))
    tot = signs @ a
    return float((1 + (tot >= obs - 1e-12 * a.sum()).sum()) / (1 + tot.size))


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values (family-wise error under any dependence)."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adj = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adj[i] = running
    return adj


def min_seeds(n_arms: int, alpha: float = ALPHA) -> int:
    """The fewest paired seeds with which the best possible result (every seed in the
    predicted direction, p = 2^-n) passes Holm's first step, ``2^-n < alpha / n_arms``."""
    n = 1
    while 2.0**-n * n_arms >= alpha:
        n += 1
    return n


def arm_family_rule(deltas: dict[str, Any], signs: dict[str, int], alpha: float = ALPHA,
                    primary: str | None = None) -> dict[str, dict[str, Any]]:
    """Claim 4 for the arms that share one baseline, as a family.

    Per arm: the sign-flip p in its predicted direction, the Holm-adjusted p over the
    family, and the verdict (holds when the adjusted p < ``alpha``; contradicted when the
    Holm-adjusted p of the opposite direction is, a second family). When the family's
    seed count cannot reach ``alpha`` even with every seed agreeing (fewer than
    :func:`min_seeds`), every arm is ``not enough data``.

    ``primary`` (pre-registered, present among the arms): a fixed-sequence design. The
    primary arm is tested alone at ``alpha``; the others (secondary) are tested with Holm
    at ``alpha`` only if the primary holds, else they are not shown ("gate closed"). The
    family-wise rate of false holds stays at most ``alpha``, and the primary needs only
    the seeds of one arm. "Contradicted" is Holm over every arm in both designs.
    """
    arms = list(deltas)
    ps = [sign_flip_p(deltas[a], signs[a]) for a in arms]
    opp = holm([sign_flip_p(deltas[a], -signs[a]) for a in arms])
    m = len(arms)
    gated = primary in arms and m > 1
    if gated:
        rest = [a for a in arms if a != primary]
        sec = dict(zip(rest, holm([ps[arms.index(a)] for a in rest])))
        adj = [ps[i] if a == primary else sec[a] for i, a in enumerate(arms)]
        gate_open = ps[arms.index(primary)] < alpha
    else:
        adj, gate_open = holm(ps), True
    out = {}
    for a, p, q, o in zip(arms, ps, adj, opp):
        n = finite_values(deltas[a])[0].size
        need = (min_seeds(1, alpha) if a == primary else min_seeds(m - 1, alpha)) if gated \
            else min_seeds(m, alpha)
        passes = q < alpha and (a == primary or gate_open)
        if n < 2 or n < need:
            verdict = NO_DATA
        else:
            verdict = HOLDS if passes else CONTRADICTED if o < alpha else NOT_SHOWN
        out[a] = {"p": p, "p_holm": q, "p_opposite_holm": o, "n_seeds": int(n), "family": m,
                  "min_seeds": need, "verdict": verdict,
                  "role": ("primary" if a == primary else "secondary") if gated else "family",
                  "gate_open": gate_open}
    return out


def all_lower_rule(deltas: Any, alpha: float = ALPHA) -> str:
    """Reality check: the arm's value below the baseline's in every seed, with enough
    seeds for that to be unlikely by chance (2^-n < ``alpha``: at least 5). The unit is
    the paired seed: whatever a seed shares between its arm and baseline trials cancels in
    the delta, and a delta with median 0 is below 0 in all n seeds with probability 2^-n.
    Contradicted when it is above in every seed (the arm raised what it should lower)."""
    d, _ = finite_values(deltas)
    if d.size == 0 or 2.0 ** -d.size >= alpha:
        return NO_DATA
    return HOLDS if (d < 0).all() else CONTRADICTED if (d > 0).all() else NOT_SHOWN


# --------------------------------------------------------------------------- claim 5


@dataclass
class SplitTrend(ResultDict):
    """A checkpoint series split into pre-specified halves (by position, the middle
    checkpoint in both when the count is odd): Spearman of value vs step in each, the
    statistic ``rho_early - rho_late`` and its p-value (one-sided, rises then decays)
    against a null of exchangeable *increments*: the series rebuilt from its own
    checkpoint-to-checkpoint changes in every order (``p_value``). A random walk is
    exactly such a null; an AR(1) series or i.i.d. values wander less than the rebuilt
    series, so the test is conservative there. ``p_exchangeable`` is the old null
    (permuted values), kept for comparison: it says "holds" on smooth noise.
    ``rises_then_decays`` needs rho_early > 0, rho_late < 0 and p < alpha."""

    n_checkpoints: int
    rho_early: float
    rho_late: float
    statistic: float
    p_value: float
    rises_then_decays: bool
    p_exchangeable: float = 1.0


# With increments permuted, 7 checkpoints reach p = 36/720 = 0.05 at best (3 rises, then
# 3 falls) and 8 reach 144/5040 = 0.029: 8 is the fewest that can pass.
MIN_CHECKPOINTS = 8
EXACT_ORDERS = 7  # the null is enumerated exactly up to 7! orders (of values or increments)


def _row_spearman_vs_position(v: np.ndarray) -> np.ndarray:
    from scipy.stats import rankdata

    r = rankdata(v, axis=1)
    r = r - r.mean(axis=1, keepdims=True)
    pos = np.arange(v.shape[1], dtype=float)
    pos -= pos.mean()
    den = np.sqrt((r**2).sum(axis=1) * (pos**2).sum())
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, (r @ pos) / den, 0.0)


def _orders(m: int, rng: np.random.Generator, n_perm: int) -> tuple[np.ndarray, bool]:
    """Every order of m items (exact) up to :data:`EXACT_ORDERS`, else ``n_perm`` random."""
    import itertools

    if m <= EXACT_ORDERS:
        return np.array(list(itertools.permutations(range(m)))), True
    return rng.permuted(np.tile(np.arange(m), (n_perm, 1)), axis=1), False


def split_trend(steps: Any, values: Any, *, rng: np.random.Generator,
                n_perm: int = N_PERM, alpha: float = ALPHA, exchangeable: bool = True
                ) -> SplitTrend:
    """Rises in the first half of the checkpoints and decays in the second, tested against
    a null of exchangeable increments (a random walk's; see :class:`SplitTrend`).
    ``exchangeable``: also compute the retired p of permuted values (else 1)."""
    s = np.asarray(steps, dtype=float).ravel()
    v = np.asarray(values, dtype=float).ravel()
    keep = np.isfinite(s) & np.isfinite(v)
    s, v = s[keep], v[keep]
    v = v[np.argsort(s, kind="stable")]
    n = int(v.size)
    if n < MIN_CHECKPOINTS:
        return SplitTrend(n, math.nan, math.nan, math.nan, 1.0, False)
    h = (n + 1) // 2

    def stat(rows: np.ndarray) -> np.ndarray:
        return (_row_spearman_vs_position(rows[:, :h])
                - _row_spearman_vs_position(rows[:, n - h:]))

    e, lt = _row_spearman_vs_position(v[None, :h])[0], _row_spearman_vs_position(
        v[None, n - h:])[0]
    obs = float(e - lt)

    def pval(null: np.ndarray, exact: bool) -> float:
        hit = int((stat(null) >= obs - 1e-12).sum())
        return hit / null.shape[0] if exact else (1 + hit) / (1 + null.shape[0])

    d = np.diff(v)
    order, exact = _orders(n - 1, rng, n_perm)
    rebuilt = np.concatenate([np.zeros((order.shape[0], 1)), np.cumsum(d[order], axis=1)],
                             axis=1)
    p = pval(rebuilt, exact)
    p_ex = pval(v[_orders(n, rng, n_perm)[0]], n <= EXACT_ORDERS) if exchangeable else 1.0
    return SplitTrend(n, float(e), float(lt), obs, p, bool(e > 0 and lt < 0 and p < alpha),
                      p_ex)


def trend_p(split: SplitTrend | dict[str, Any] | None) -> float:
    """A model's p for "rises then decays": its p-value when rho_early > 0 and
    rho_late < 0, else 1."""
    if split is None:
        return 1.0
    d = split.to_dict() if isinstance(split, SplitTrend) else split
    if not (d.get("rho_early", math.nan) > 0 and d.get("rho_late", math.nan) < 0):
        return 1.0
    return float(d["p_value"])


def binom_tail(k: int, m: int, q: float) -> float:
    """``P(X >= k)`` for ``X ~ Binomial(m, q)``."""
    if k <= 0:
        return 1.0
    if q == 0.5:
        return binom_tail_half(k, m)
    return float(sum(math.comb(m, i) * q**i * (1 - q) ** (m - i) for i in range(k, m + 1)))


def several_level(m: int, alpha: float = ALPHA) -> float:
    """The level each of ``m`` models is tested at for "several" (at least two): with
    ``2 alpha / m`` the count N of models passing by chance has E[N] <= 2 alpha, so
    P(N >= 2) <= alpha by Markov's inequality, however the models depend on each other
    (Pythia sizes share their data order and checkpoint steps)."""
    return min(alpha, 2 * alpha / m) if m else alpha


def several_rule(p_values: Any, alpha: float = ALPHA) -> str:
    """"Several models" made explicit: at least two of the ``m`` models tested have
    p < :func:`several_level` (m). Valid under any dependence between the models.
    Fewer than two models: not enough data."""
    ps = [float(p) for p in p_values]
    m = len(ps)
    if m < 2:
        return NO_DATA
    return HOLDS if sum(p < several_level(m, alpha) for p in ps) >= 2 else NOT_SHOWN


@dataclass
class StratifiedLink(ResultDict):
    """Spearman across layers within each checkpoint, pooled over checkpoints (a trend
    shared by both metrics over training cannot make it), with a percentile interval from
    a bootstrap that resamples whole checkpoints (descriptive). The test takes the layer
    as its unit: ``p_value`` (one-sided, predicted > 0) permutes whole layers of y, the
    same permutation at every checkpoint, so each layer's profile and its course over
    checkpoints stay intact; fixed per-layer profiles of the two metrics that are not
    coupled cannot make it (the old sign-flip over checkpoints, ``p_checkpoints``, said
    "holds" 26-30% of the time there). The smallest p is 1 / layers!: 4 layers reach
    1/24. ``holds`` needs p < alpha."""

    rho: float
    p_value: float
    ci_low: float
    ci_high: float
    n_checkpoints: int
    n_points: int
    n_boot: int
    holds: bool
    n_layers: int = 0
    p_checkpoints: float = 1.0


def _layer_matrix(x: np.ndarray, y: np.ndarray, c: np.ndarray, layer: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
    """x and y as (checkpoint, layer) matrices of the checkpoints complete in every layer."""
    cs, ci = np.unique(c, return_inverse=True)
    ls, li = np.unique(layer, return_inverse=True)
    mx = np.full((cs.size, ls.size), np.nan)
    my = mx.copy()
    mx[ci, li], my[ci, li] = x, y
    full = np.isfinite(mx).all(axis=1) & np.isfinite(my).all(axis=1)
    return mx[full], my[full]


def stratified_link(x: Any, y: Any, checkpoints: Any, layers: Any = None, *,
                    rng: np.random.Generator, n_boot: int = 2000, ci: float = 0.95,
                    n_perm: int = N_PERM, alpha: float = ALPHA) -> StratifiedLink:
    """The rank-entropy link of one model: ``x`` and ``y`` per (checkpoint, layer) point,
    ``checkpoints`` and ``layers`` the checkpoint and layer of each point (``layers``
    None: the points of a checkpoint in order)."""
    x = np.asarray(x, dtype=float).ravel()
    y = np.asarray(y, dtype=float).ravel()
    c = np.asarray(checkpoints).ravel()
    if layers is None:
        layers = np.zeros(c.size, dtype=int)
        for key in np.unique(c):
            layers[c == key] = np.arange(int((c == key).sum()))
    keep = np.isfinite(x) & np.isfinite(y)
    mx, my = _layer_matrix(x[keep], y[keep], c[keep], np.asarray(layers).ravel()[keep])
    n_c, n_l = mx.shape
    if n_c == 0 or n_l < 2:
        return StratifiedLink(math.nan, 1.0, math.nan, math.nan, n_c, int(x.size), 0, False,
                              n_l)
    rx, ry = _centred_ranks(mx.T).T, _centred_ranks(my.T).T  # ranks across layers
    a = np.stack([(rx * ry).sum(axis=1), (rx**2).sum(axis=1), (ry**2).sum(axis=1)], axis=1)

    def ratio(s: np.ndarray) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return s[..., 0] / np.sqrt(s[..., 1] * s[..., 2])

    rho = float(ratio(a.sum(axis=0)))
    boot = ratio(a[rng.integers(0, n_c, (n_boot, n_c))].sum(axis=1))
    boot = boot[np.isfinite(boot)]
    lo, hi = (np.quantile(boot, [(1 - ci) / 2, (1 + ci) / 2]) if boot.size
              else (math.nan, math.nan))
    g = rx.T @ ry  # [l, l'] = sum over checkpoints of rank x in l times rank y in l'
    order, exact = _orders(n_l, rng, n_perm)
    perm = g[np.arange(n_l)[None, :], order].sum(axis=1)
    obs = float(np.trace(g))
    hit = int((perm >= obs - 1e-9 * max(1.0, abs(obs))).sum())
    p = hit / order.shape[0] if exact else (1 + hit) / (1 + order.shape[0])
    if not math.isfinite(rho):
        p = 1.0
    p_c = sign_flip_p(ratio(a), 1, rng=rng)
    return StratifiedLink(rho, p, float(lo), float(hi), n_c, int(x.size), n_boot,
                          bool(p < alpha), n_l, p_c)
