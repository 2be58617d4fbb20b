"""Sign tests, slopes over training progress, the initial collapse, and bootstrap
directional confidence of paired effects."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qkgeom.stats.common import ResultDict, binom_tail_half, finite_values

# The paper asks for B >= 10,000 bootstrap resamples for directional confidence.
MIN_BOOT_DIRECTIONAL = 10_000


# --------------------------------------------------------------------------- sign test


@dataclass
class SignTestResult(ResultDict):
    """One-sided exact sign test. ``p_value = P(X >= n_positive)``, ``X ~ Bin(n, 1/2)``.

    ``n`` counts the non-zero finite differences only: exact zeros are ties and are
    excluded (the classical convention), non-finite values are dropped; both are counted.
    ``n_positive`` counts differences with the predicted sign (``> 0`` when
    ``predicted_sign=+1``, ``< 0`` when ``-1``).
    """

    n: int
    n_positive: int
    n_negative: int
    n_zero: int
    n_dropped: int
    p_value: float
    predicted_sign: int = 1


def sign_test(diffs: Sequence[float] | np.ndarray, *, predicted_sign: int = 1) -> SignTestResult:
    """Exact one-sided sign test that the differences tend to have ``predicted_sign``.

    With every one of n differences in the predicted direction, p = 2^-n (5 seeds: 1/32).
    An empty input gives ``n = 0`` and ``p_value = 1.0`` (no evidence).
    """
    if predicted_sign not in (1, -1):
        raise ValueError(f"predicted_sign must be +1 or -1, got {predicted_sign!r}")
    d, dropped = finite_values(diffs)
    d = d * predicted_sign
    pos = int((d > 0).sum())
    neg = int((d < 0).sum())
    zero = int((d == 0).sum())
    n = pos + neg
    return SignTestResult(n=n, n_positive=pos, n_negative=neg, n_zero=zero, n_dropped=dropped,
                          p_value=binom_tail_half(pos, n), predicted_sign=predicted_sign)


# --------------------------------------------------------------------------- slopes


@dataclass
class SlopesResult(ResultDict):
    """Least-squares slopes, one per trajectory, and their distribution.

    ``slopes[i]`` is in value units per unit of ``progress`` (progress = step / max_steps,
    so the slope is the change over a whole run). A trajectory with fewer than two
    distinct finite progress values has slope NaN and is left out of the summary
    (``n_undefined``).
    """

    slopes: list[float]
    intercepts: list[float]
    n: int
    n_undefined: int
    mean: float
    median: float
    sd: float  # sample standard deviation (ddof=1); NaN with fewer than 2 slopes
    share_positive: float
    n_positive: int


def ols_line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Slope and intercept of the least-squares line ``y ~ a + b x`` (finite pairs only)."""
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    keep = np.isfinite(x) & np.isfinite(y)
    x, y = x[keep], y[keep]
    if x.size < 2 or np.ptp(x) == 0:
        return math.nan, math.nan
    xm, ym = x.mean(), y.mean()
    b = float(((x - xm) * (y - ym)).sum() / ((x - xm) ** 2).sum())
    return b, float(ym - b * xm)


# The initial collapse is searched for in the first half of training: both PRs fall from
# their random-init values within the first few probes (PAPER.md: ~17 -> ~2 in the first
# 100 of 1,500 steps), while later minima of PR_Q + PR_K are slow drifts, not the collapse.
COLLAPSE_SEARCH = 0.5


def collapse_index(progress: Any, total: Any, *, search: float = COLLAPSE_SEARCH) -> int:
    """Index of the probe that ends the initial collapse of one trajectory.

    ``progress`` (ascending, step / max_steps) and ``total`` (PR_Q + PR_K at each probe)
    are 1-D and of equal length. The collapse point is the probe with the lowest ``total``
    among the probes with ``progress <= search``; the earliest one on ties; non-finite
    values are ignored. Returns -1 when no probe qualifies.
    """
    p = np.asarray(progress, dtype=float).ravel()
    t = np.asarray(total, dtype=float).ravel()
    if p.shape != t.shape:
        raise ValueError(f"progress has {p.size} points but total has {t.size}")
    ok = np.isfinite(p) & np.isfinite(t) & (p <= search)
    if not ok.any():
        return -1
    idx = np.flatnonzero(ok)
    return int(idx[np.argmin(t[idx])])  # argmin returns the first minimum


def slopes(progress: Sequence[Any], values: Sequence[Any]) -> SlopesResult:
    """Slope of ``values`` against ``progress`` for each trajectory, plus a summary.

    ``progress`` and ``values`` are sequences of equal-length 1-D arrays (ragged allowed:
    trajectory i is ``(progress[i], values[i])``), or two 2-D arrays ``(n_traj, n_points)``.
    """
    if len(progress) != len(values):
        raise ValueError(f"{len(progress)} progress arrays but {len(values)} value arrays")
    bs, a_s = [], []
    for p, v in zip(progress, values):
        p = np.asarray(p, dtype=float).ravel()
        v = np.asarray(v, dtype=float).ravel()
        if p.shape != v.shape:
            raise ValueError(f"progress has {p.size} points but values has {v.size}")
        b, a = ols_line(p, v)
        bs.append(b)
        a_s.append(a)
    arr = np.asarray(bs, dtype=float)
    ok = arr[np.isfinite(arr)]
    n = int(ok.size)
    return SlopesResult(
        slopes=bs, intercepts=a_s, n=n, n_undefined=int(arr.size - n),
        mean=float(ok.mean()) if n else math.nan,
        median=float(np.median(ok)) if n else math.nan,
        sd=float(ok.std(ddof=1)) if n > 1 else math.nan,
        share_positive=float((ok > 0).mean()) if n else math.nan,
        n_positive=int((ok > 0).sum()),
    )


# --------------------------------------------------------------------------- bootstrap


def bootstrap_means(x: np.ndarray, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """Means of ``n_boot`` resamples (with replacement) of the 1-D sample ``x``.

    Draws ``rng.integers(0, n, (n_boot, n))`` in one call, exactly like
    ``scipy.stats.bootstrap`` with ``batch=None``, so the same generator state gives the
    same bootstrap distribution as scipy.
    """
    x = np.asarray(x, dtype=float)
    idx = rng.integers(0, x.size, (n_boot, x.size))
    return x[idx].mean(axis=-1)


def t_interval(x: Any, ci: float = 0.95) -> tuple[float, float]:
    """Student's t interval of the mean of the finite values of ``x`` (NaN with fewer
    than 2): exact under normal deltas, and the interval whose coverage the calibration
    checks at few seeds (the BCa covers far less than its nominal rate at 5)."""
    from scipy.stats import t

    d = np.asarray(x, dtype=float).ravel()
    d = d[np.isfinite(d)]
    if d.size < 2:
        return math.nan, math.nan
    half = float(t.ppf((1 + ci) / 2, d.size - 1)) * float(d.std(ddof=1)) / math.sqrt(d.size)
    return float(d.mean() - half), float(d.mean() + half)


def bca_interval(x: np.ndarray, boot: np.ndarray, *, ci: float = 0.95,
                 statistic: Any = np.mean) -> tuple[float, float, float, float]:
    """Bias-corrected and accelerated (BCa) bootstrap interval (Efron & Tibshirani 14.3).

    ``boot`` is the bootstrap distribution of ``statistic`` over resamples of ``x``.
    Bias correction ``z0 = Phi^-1(share of boot < theta, ties counting half)``;
    acceleration from the jackknife: ``a = sum(U^3) / (6 (sum U^2)^1.5)`` with
    ``U_i = (n-1)(mean(theta_(.)) - theta_(i))``. The interval is the boot quantiles at
    ``Phi(z0 + (z0 + z)/(1 - a (z0 + z)))`` for ``z = Phi^-1(alpha/2), Phi^-1(1-alpha/2)``.
    Returns ``(low, high, z0, a)``. A degenerate distribution (all equal) gives
    ``(theta, theta, nan, nan)``.
    """
    from scipy.special import ndtr, ndtri

    x = np.asarray(x, dtype=float)
    boot = np.asarray(boot, dtype=float)
    theta = float(statistic(x))
    if np.ptp(boot) == 0:
        return theta, theta, math.nan, math.nan
    share = ((boot < theta).sum() + (boot <= theta).sum()) / (2 * boot.size)
    z0 = float(ndtri(share))
    n = x.size
    jack = np.array([statistic(np.delete(x, i)) for i in range(n)])
    u = (n - 1) * (jack.mean() - jack)
    den = (u**2).sum() / n**2
    a = float(1 / 6 * ((u**3).sum() / n**3) / den**1.5) if den > 0 else 0.0
    alpha = (1 - ci) / 2
    qs = []
    for z in (float(ndtri(alpha)), -float(ndtri(alpha))):
        num = z0 + z
        qs.append(float(ndtr(z0 + num / (1 - a * num))))
    if not all(np.isfinite(qs)):
        return math.nan, math.nan, z0, a
    low, high = np.quantile(boot, qs)
    return float(low), float(high), z0, a


@dataclass
class DirectionalResult(ResultDict):
    """Bootstrap directional confidence of a paired effect (one delta per seed).

    ``ci_low``/``ci_high`` are the BCa interval; ``pct_low``/``pct_high`` the percentile
    interval, both at level ``ci`` over the same ``n_boot`` bootstrap means.
    ``directional_confidence`` is the share of bootstrap means whose sign is
    ``predicted_sign`` (strictly; a zero mean counts for neither sign).
    """

    n_seeds: int
    n_dropped: int
    deltas: list[float]
    mean_delta: float
    sd_delta: float
    predicted_sign: int
    n_boot: int
    ci: float
    ci_low: float
    ci_high: float
    pct_low: float
    pct_high: float
    bca_z0: float
    bca_accel: float
    boot_se: float
    directional_confidence: float
    sign_test_p: float
    n_agree: int  # seeds whose delta has the predicted sign
    boot_means: list[float] = field(default_factory=list, repr=False)

    def to_dict(self, *, with_boot: bool = False) -> dict[str, Any]:
        d = super().to_dict()
        if not with_boot:
            d.pop("boot_means")
        return d


def directional_confidence(delta: Sequence[float] | np.ndarray, *, predicted_sign: int,
                           rng: np.random.Generator, n_boot: int = MIN_BOOT_DIRECTIONAL,
                           ci: float = 0.95) -> DirectionalResult:
    """Bootstrap the mean of per-seed paired differences and ask how often its sign agrees.

    ``delta`` holds one paired difference per seed (arm minus baseline). Needs at least
    two finite deltas and ``n_boot >= 10000`` (the paper's B). The sign-test p is the exact
    one-sided paired sign test in the predicted direction; with 5 seeds it cannot go below
    1/32, which is why the bootstrap figure is reported beside it.
    """
    if predicted_sign not in (1, -1):
        raise ValueError(f"predicted_sign must be +1 or -1, got {predicted_sign!r}")
    if n_boot < MIN_BOOT_DIRECTIONAL:
        raise ValueError(f"n_boot must be >= {MIN_BOOT_DIRECTIONAL} (got {n_boot})")
    if not 0 < ci < 1:
        raise ValueError(f"ci must be in (0, 1), got {ci}")
    d, dropped = finite_values(delta)
    if d.size < 2:
        raise ValueError(f"need at least 2 finite paired differences, got {d.size}")
    boot = bootstrap_means(d, n_boot, rng)
    alpha = (1 - ci) / 2
    pl, ph = np.quantile(boot, [alpha, 1 - alpha])
    bl, bh, z0, a = bca_interval(d, boot, ci=ci)
    st = sign_test(d, predicted_sign=predicted_sign)
    return DirectionalResult(
        n_seeds=int(d.size), n_dropped=dropped, deltas=d.tolist(), mean_delta=float(d.mean()),
        sd_delta=float(d.std(ddof=1)), predicted_sign=predicted_sign, n_boot=n_boot, ci=ci,
        ci_low=bl, ci_high=bh, pct_low=float(pl), pct_high=float(ph), bca_z0=z0,
        bca_accel=a, boot_se=float(boot.std(ddof=1)),
        directional_confidence=float((np.sign(boot) == predicted_sign).mean()),
        sign_test_p=st.p_value, n_agree=st.n_positive, boot_means=boot.tolist(),
    )
