"""The study's statistics: pure numpy/scipy functions over plain arrays.

Nothing here touches the database, polars, plotting or the CLI. Every function that draws
random numbers takes an explicit ``rng: numpy.random.Generator``; the same generator state
gives the same result, bit for bit. Results are small dataclasses with ``to_dict()`` whose
values are plain Python floats/ints/lists (JSON-ready; NaN stays NaN).

Conventions
-----------
* Non-finite inputs (NaN, inf) are dropped before any test and counted in the result
  (``n_dropped``); a metric that failed to compute must not count as evidence.
* One-sided tests are one-sided in the *predicted* direction; the p-value is the exact
  binomial tail ``P(X >= k)`` with ``X ~ Binomial(n, 1/2)``, computed with exact integer
  arithmetic (equals ``scipy.stats.binomtest(k, n, 0.5, alternative='greater')``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np

from qkgeom.records import to_jsonable

# The paper asks for B >= 10,000 bootstrap resamples for directional confidence.
MIN_BOOT_DIRECTIONAL = 10_000


class _ToDict:
    def to_dict(self) -> dict[str, Any]:
        return to_jsonable(asdict(self), finite=False)  # type: ignore[call-overload]


def _finite(x: Any) -> tuple[np.ndarray, int]:
    a = np.asarray(x, dtype=float).ravel()
    keep = np.isfinite(a)
    return a[keep], int(a.size - keep.sum())


def binom_tail_half(k: int, n: int) -> float:
    """Exact ``P(X >= k)`` for ``X ~ Binomial(n, 1/2)``; 1.0 when ``k <= 0``, 0.0 if ``k > n``."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    tail = sum(math.comb(n, i) for i in range(k, n + 1))
    return float(Fraction(tail, 2**n))


# --------------------------------------------------------------------------- sign test


@dataclass
class SignTestResult(_ToDict):
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
    d, dropped = _finite(diffs)
    d = d * predicted_sign
    pos = int((d > 0).sum())
    neg = int((d < 0).sum())
    zero = int((d == 0).sum())
    n = pos + neg
    return SignTestResult(n=n, n_positive=pos, n_negative=neg, n_zero=zero, n_dropped=dropped,
                          p_value=binom_tail_half(pos, n), predicted_sign=predicted_sign)


# --------------------------------------------------------------------------- slopes


@dataclass
class SlopesResult(_ToDict):
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
class DirectionalResult(_ToDict):
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
    d, dropped = _finite(delta)
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


# --------------------------------------------------------------------------- Spearman


def _avg_ranks(a: np.ndarray) -> np.ndarray:
    """1-based ranks with ties given their mean rank; equals ``scipy.stats.rankdata(a)``
    (computed here to keep the slow ``scipy.stats`` import off every command's path)."""
    a = np.asarray(a, dtype=float).ravel()
    n = a.size
    order = np.argsort(a, kind="mergesort")
    s = a[order]
    is_start = np.ones(n, dtype=bool)
    is_start[1:] = s[1:] != s[:-1]
    starts = np.flatnonzero(is_start)
    counts = np.diff(np.append(starts, n))
    avg = starts + 0.5 * (counts + 1)  # group of c ties starting at s: ranks s+1..s+c
    out = np.empty(n, dtype=float)
    out[order] = np.repeat(avg, counts)
    return out


def _pearson(a: np.ndarray, b: np.ndarray) -> float:
    a = a - a.mean()
    b = b - b.mean()
    den = math.sqrt(float((a * a).sum()) * float((b * b).sum()))
    return float((a * b).sum() / den) if den > 0 else math.nan


def spearman(x: Any, y: Any) -> float:
    """Spearman's rho: Pearson correlation of average ranks (ties get the mean rank).

    NaN when either variable is constant. Inputs must be finite and of equal length.
    """
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    return _pearson(_avg_ranks(x), _avg_ranks(y))


class _WeightedRanks:
    """Centred, doubled average ranks of a variable within a bootstrap resample.

    A resample is given by ``w``, how many times each original point was drawn. The
    average rank of a value in the resample is (drawn values below it) + (drawn copies of
    it + 1) / 2, so cumulative draw counts over the sorted values give exactly
    ``rankdata`` of the resample in O(n), without sorting per resample. Ranks are doubled
    (integers, exact in int64) and centred by their known mean ``(n + 1) / 2``; Pearson
    correlation is unchanged by both. Tied values are handled per group of equal values:
    the draws up to the group's last member (one gather from a full cumulative sum; no
    ``reduceat``, which costs as much as the rest together).
    """

    def __init__(self, v: np.ndarray):
        n = v.size
        order = np.argsort(v, kind="stable")
        vs = v[order]
        is_start = np.ones(n, dtype=bool)
        is_start[1:] = vs[1:] != vs[:-1]
        starts = np.flatnonzero(is_start)
        self.ends = np.append(starts[1:], n) - 1  # sorted position of each group's last
        self.ties = starts.size < n
        self.identity = bool(np.all(order == np.arange(n)))
        self.order = order
        inv = np.empty(n, dtype=np.intp)
        inv[order] = np.cumsum(is_start) - 1  # point -> index of its unique value
        self.inv = inv

        # Work buffers reused across resamples: fresh 100k-element temporaries per call
        # cost more in page faults and cache misses than the arithmetic itself.
        u = starts.size
        self._c = np.empty(n, dtype=np.int64)
        self._cum = np.empty(n, dtype=np.int64)
        self._out = np.empty(n, dtype=np.int64)
        self._ce = np.empty(u, dtype=np.int64)
        self._g = np.empty(u, dtype=np.int64)
        self._cnt = np.empty(u, dtype=np.int64)
        self._tmp = np.empty(u, dtype=np.int64)

    def ranks_ss(self, w: np.ndarray, n: int) -> tuple[np.ndarray, int]:
        """Doubled, centred ranks (int64) of every original point in the resample ``w``,
        and their sum of squares over the resample, ``sum(w * r**2)`` (exact int)."""
        c = w if self.identity else np.take(w, self.order, out=self._c)
        cum = np.cumsum(c, out=self._cum)
        if self.ties:
            ce = np.take(cum, self.ends, out=self._ce)  # drawn values <= the group's value
            g = self._g
            g[0] = 0
            g[1:] = ce[:-1]  # drawn values below the group
            cnt = np.subtract(ce, g, out=self._cnt)  # drawn copies of the group's value
            g += ce
            g -= n  # 2 * (avg rank - (n + 1) / 2) = below + (below + copies) - n
            ss = int(np.dot(np.multiply(cnt, g, out=self._tmp), g))
            return np.take(g, self.inv, out=self._out), ss
        cum *= 2
        cum -= c
        cum -= n
        ss = int(np.dot(np.multiply(c, cum, out=self._c if c is not w else self._out), cum))
        if self.identity:
            return cum, ss
        return np.take(cum, self.inv, out=self._out), ss

    def __call__(self, w: np.ndarray, n: int) -> np.ndarray:
        """Doubled, centred ranks (int64) of every original point in the resample ``w``."""
        return self.ranks_ss(w, n)[0]


# Below this many points the resample sums fit in int64 exactly (|sum| <= n^3 < 2^63).
_EXACT_INT_N = 1_000_000


def _resample_spearman(w: np.ndarray, rx: _WeightedRanks, ry: _WeightedRanks,
                       buf: np.ndarray | None = None) -> float:
    """Spearman rho of the resample in which point i appears ``w[i]`` times (int64).

    ``rx`` and ``ry`` rank the same points in the same order as ``w``; ``buf`` is an
    optional int64 work array of ``w``'s length.
    """
    n = int(w.sum())
    a, saa = rx.ranks_ss(w, n)
    b, sbb = ry.ranks_ss(w, n)
    if n > _EXACT_INT_N:
        sab = float(np.dot(w.astype(float) * a, b.astype(float)))
    else:
        # int64 dot products are exact; float() only at the end
        sab = float(np.dot(np.multiply(w, a, out=buf), b))
    den = math.sqrt(float(saa) * float(sbb))
    return sab / den if den > 0 else math.nan


@dataclass
class SpearmanResult(_ToDict):
    """Spearman's rho with a bootstrap percentile CI.

    ``resample`` says what the bootstrap drew: ``"clusters"`` (whole groups of points,
    e.g. every probe of one trial, ``n_clusters`` of them) or ``"points"`` (single (x, y)
    pairs, as if independent). ``n_boot_undefined`` counts resamples in which one variable
    was constant (rho undefined); they are left out of the quantiles.
    """

    n: int
    n_dropped: int
    rho: float
    ci_low: float
    ci_high: float
    ci: float
    n_boot: int
    n_boot_undefined: int = 0
    resample: str = "points"
    n_clusters: int | None = None


class _ClusterRankSums:
    """Spearman's rho of any cluster-bootstrap resample in O(T^3), T = number of clusters.

    In a resample where cluster u is drawn ``c[u]`` times, every point of u appears
    ``c[u]`` times. The doubled, centred average rank of point i there is exactly linear
    in the draw counts: ``2 R_i - (N + 1) = sum_u c[u] * D[i, u]``, where
    ``D[i, u] = #{j in u: v_j < v_i} - #{j in u: v_j > v_i}`` (ties included: a tied
    value's copies sit half below, half above it). So the resample's rank cross-product
    ``sum_i c[t(i)] (D^x_i . c)(D^y_i . c)`` is the cubic form
    ``sum_{t,u,w} c_t c_u c_w G[t, u, w]`` with ``G[t] = D^x_t^T D^y_t`` summed over the
    points of cluster t. The three tensors (xx, yy, xy) are built once in O(n T^2); each
    resample then costs O(T^3) whatever the number of points.
    """

    def __init__(self, x: np.ndarray, y: np.ndarray, codes: np.ndarray, n_clusters: int):
        T = n_clusters
        members = np.argsort(codes, kind="stable")
        bounds = np.searchsorted(codes[members], np.arange(T + 1))
        # (clusters x points) tables, points grouped by cluster: float64 for BLAS, exact
        # (every entry and every partial sum of G is an integer below 2^53)
        dx = self._signed_counts(x, codes, T)[:, members].astype(float)
        dy = self._signed_counts(y, codes, T)[:, members].astype(float)
        self.T = T
        self.g = np.empty((3, T, T, T))  # xx, yy, xy
        for t in range(T):
            a = dx[:, bounds[t]:bounds[t + 1]]
            b = dy[:, bounds[t]:bounds[t + 1]]
            self.g[0, t] = a @ a.T
            self.g[1, t] = b @ b.T
            self.g[2, t] = a @ b.T

    @staticmethod
    def _signed_counts(v: np.ndarray, codes: np.ndarray, T: int) -> np.ndarray:
        """``D`` transposed, (clusters x points), int32: for point i and cluster u, the
        points of u below v_i minus the points of u above v_i."""
        uniq, inv = np.unique(v, return_inverse=True)
        U = uniq.size
        # per cluster (rows) and unique value (columns, ascending): how many points
        cnt = np.bincount(codes * U + inv, minlength=T * U).astype(np.int32).reshape(T, U)
        upto = np.cumsum(cnt, axis=1, dtype=np.int32)  # points of u with value <= this one
        d = upto + upto  # below - above = (upto - cnt) + upto - n_u
        d -= cnt
        d -= upto[:, -1:]
        return d[:, inv]

    def rhos(self, counts: np.ndarray, chunk: int = 256) -> np.ndarray:
        """rho for each row of ``counts`` (resamples x clusters, draw counts)."""
        T = self.T
        out = np.empty(counts.shape[0])
        flat = self.g.reshape(3, T, T * T)
        for s in range(0, counts.shape[0], chunk):
            c = counts[s:s + chunk].astype(float)
            sums = []
            for k in range(3):
                h = (c @ flat[k]).reshape(-1, T, T)  # sum_t c_t G[t, u, w]
                sums.append(np.einsum("buw,bu,bw->b", h, c, c))
            sxx, syy, sxy = sums
            den = np.sqrt(sxx * syy)
            with np.errstate(invalid="ignore", divide="ignore"):
                out[s:s + chunk] = np.where(den > 0, sxy / np.where(den > 0, den, 1.0), np.nan)
        return out


def _cluster_rhos_by_points(x: np.ndarray, y: np.ndarray, codes: np.ndarray,
                            counts: np.ndarray) -> np.ndarray:
    """The same resamples as :class:`_ClusterRankSums`, in O(n) each: every point is
    weighted by its cluster's draw count and ranked by :class:`_WeightedRanks`. Used when
    there are too many clusters for the O(T^3) tensors."""
    order = np.argsort(x, kind="stable")
    rx, ry = _WeightedRanks(x[order]), _WeightedRanks(y[order])
    code_sorted = codes[order]
    buf = np.empty(x.size, dtype=np.int64)
    out = np.empty(counts.shape[0])
    for b in range(counts.shape[0]):
        w = np.take(counts[b].astype(np.int64), code_sorted)
        out[b] = _resample_spearman(w, rx, ry, buf)
    return out


# The O(T^3) path holds 3 T^3 floats and costs about 6 T^3 flops per resample; the
# per-point path costs roughly 25 ns per point per resample (benchmarks/stats.py data).
_TENSOR_MAX_CLUSTERS = 192


def _use_tensor(n: int, T: int) -> bool:
    # the build holds two (clusters x points) float64 tables: keep each under ~160 MB
    return T <= _TENSOR_MAX_CLUSTERS and T**3 <= 16 * n and n * T <= 20_000_000


def _quantile_ci(rhos: np.ndarray, ci: float) -> tuple[float, float, int]:
    ok = rhos[np.isfinite(rhos)]
    alpha = (1 - ci) / 2
    lo, hi = np.quantile(ok, [alpha, 1 - alpha]) if ok.size else (math.nan, math.nan)
    return float(lo), float(hi), int(rhos.size - ok.size)


def spearman_ci(x: Any, y: Any, *, n_boot: int = 1000, rng: np.random.Generator,
                ci: float = 0.95, clusters: Any = None, method: str = "auto"
                ) -> SpearmanResult:
    """Spearman's rho of finite (x, y) pairs and a bootstrap percentile CI.

    Pairs where either value is non-finite are dropped first. Fewer than 3 pairs give
    NaN throughout.

    ``clusters=None`` resamples pairs: each resample draws ``rng.integers(0, n, n)``
    (as ``scipy.stats.bootstrap(paired=True)``). With ``clusters`` (one label per pair,
    e.g. the trial each probe came from) it is a cluster bootstrap: each resample draws
    ``rng.integers(0, T, T)`` of the T clusters and keeps every pair of each drawn
    cluster, as often as it was drawn; rho of the pooled resample. Fewer than 3 clusters
    give a NaN CI. ``method`` (cluster bootstrap only): ``"tensor"`` (O(T^3) per
    resample), ``"points"`` (O(n) per resample) or ``"auto"``; they give the same numbers
    up to float rounding.
    """
    x = np.asarray(x, dtype=float).ravel()
    y = np.asarray(y, dtype=float).ravel()
    if x.shape != y.shape:
        raise ValueError(f"x has {x.size} values but y has {y.size}")
    if method not in ("auto", "tensor", "points"):
        raise ValueError(f"method must be auto, tensor or points, got {method!r}")
    keep = np.isfinite(x) & np.isfinite(y)
    codes = None
    if clusters is not None:
        labels = np.asarray(clusters).ravel()
        if labels.shape != keep.shape:
            raise ValueError(f"clusters has {labels.size} labels for {keep.size} pairs")
        codes = np.unique(labels[keep], return_inverse=True)[1].astype(np.intp)
    x, y = x[keep], y[keep]
    n = int(x.size)
    dropped = int(keep.size - n)
    T = None if codes is None else (int(codes.max()) + 1 if n else 0)
    kind = "points" if codes is None else "clusters"
    nan = math.nan
    if n < 3:
        return SpearmanResult(n=n, n_dropped=dropped, rho=nan, ci_low=nan, ci_high=nan,
                              ci=ci, n_boot=n_boot, resample=kind, n_clusters=T)
    rho = spearman(x, y)
    if codes is not None:
        if T < 3:
            return SpearmanResult(n=n, n_dropped=dropped, rho=rho, ci_low=nan, ci_high=nan,
                                  ci=ci, n_boot=n_boot, resample=kind, n_clusters=T)
        counts = np.empty((n_boot, T), dtype=np.int64)
        for b in range(n_boot):
            counts[b] = np.bincount(rng.integers(0, T, T), minlength=T)
        tensor = method == "tensor" or (method == "auto" and _use_tensor(n, T))
        rhos = (_ClusterRankSums(x, y, codes, T).rhos(counts) if tensor
                else _cluster_rhos_by_points(x, y, codes, counts))
        lo, hi, bad = _quantile_ci(rhos, ci)
        return SpearmanResult(n=n, n_dropped=dropped, rho=rho, ci_low=lo, ci_high=hi, ci=ci,
                              n_boot=n_boot, n_boot_undefined=bad, resample=kind,
                              n_clusters=T)
    # Sort pairs by x so x's rank lookups run sequentially in memory (speed only).
    order = np.argsort(x, kind="stable")
    rx, ry = _WeightedRanks(x[order]), _WeightedRanks(y[order])
    # int32 draws are the same numbers as int64 ones (both come from 32-bit bounded
    # draws when n < 2**32) and halve the memory traffic of the gathers below.
    dt = np.int32 if n < 2**31 else np.intp
    pos = np.empty(n, dtype=dt)
    pos[order] = np.arange(n, dtype=dt)
    p = np.empty(n, dtype=dt)
    buf = np.empty(n, dtype=np.int64)
    rhos = np.empty(n_boot)
    for b in range(n_boot):
        idx = rng.integers(0, n, n, dtype=dt)
        w = np.bincount(np.take(pos, idx, out=p), minlength=n)
        rhos[b] = _resample_spearman(w, rx, ry, buf)
    lo, hi, bad = _quantile_ci(rhos, ci)
    return SpearmanResult(n=n, n_dropped=dropped, rho=rho, ci_low=lo, ci_high=hi, ci=ci,
                          n_boot=n_boot, n_boot_undefined=bad, resample=kind)


# --------------------------------------------------------------------------- checkpoints


@dataclass
class TrendResult(_ToDict):
    """Trend of one value (e.g. PR_Q - PR_K) over a model's training checkpoints.

    * ``rho``: Spearman of value vs step over all checkpoints.
    * ``peak_step``: step of the largest value (first one on ties); ``peak_index`` its
      position among the checkpoints sorted by step.
    * ``rho_early``: Spearman over checkpoints from the first up to and including the
      peak; ``rho_late``: over the peak and every later checkpoint. Each needs at least
      3 checkpoints, else NaN.
    * ``rises_then_decays`` ("monotonic early, decaying later") is True exactly when
      ``rho_early > 0`` and ``rho_late < 0``: the peak is strictly inside the run, with at
      least 2 checkpoints before it and 2 after it. ``monotonic_early`` is
      ``rho_early == 1`` (a strictly increasing run up to the peak).
    """

    n_checkpoints: int
    steps: list[int]
    values: list[float]
    rho: float
    peak_step: int | None
    peak_index: int | None
    peak_value: float
    rho_early: float
    rho_late: float
    n_early: int
    n_late: int
    rises_then_decays: bool
    monotonic_early: bool


def checkpoint_trend(steps: Any, values: Any) -> TrendResult:
    """Spearman trend of ``values`` against checkpoint ``steps``, split at the peak.

    Checkpoints with a non-finite value are dropped; duplicate steps are an error (average
    them first).
    """
    s = np.asarray(steps, dtype=float).ravel()
    v = np.asarray(values, dtype=float).ravel()
    if s.shape != v.shape:
        raise ValueError(f"{s.size} steps but {v.size} values")
    keep = np.isfinite(s) & np.isfinite(v)
    s, v = s[keep], v[keep]
    order = np.argsort(s, kind="stable")
    s, v = s[order], v[order]
    if np.any(np.diff(s) == 0):
        raise ValueError("duplicate checkpoint steps; average values per step first")
    n = int(s.size)
    if n == 0:
        return TrendResult(0, [], [], math.nan, None, None, math.nan, math.nan, math.nan,
                           0, 0, False, False)
    k = int(np.argmax(v))
    rho = spearman(s, v) if n >= 3 else math.nan
    early = spearman(s[: k + 1], v[: k + 1]) if k + 1 >= 3 else math.nan
    late = spearman(s[k:], v[k:]) if n - k >= 3 else math.nan
    return TrendResult(
        n_checkpoints=n, steps=[int(x) for x in s], values=v.tolist(), rho=rho,
        peak_step=int(s[k]), peak_index=k, peak_value=float(v[k]), rho_early=early,
        rho_late=late, n_early=k + 1, n_late=n - k,
        rises_then_decays=bool(early > 0 and late < 0),
        monotonic_early=bool(early == 1.0),
    )
