"""Spearman's rho and its bootstrap CIs, over points or over clusters (whole trials),
with rank sums that make each resample cheap."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from qkgeom.stats.common import ResultDict


def tie_groups(v: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(order, is_start, starts)`` of a 1-d array: the stable sort order, whether each
    sorted position starts a group of equal values, and the groups' first positions."""
    order = np.argsort(v, kind="stable")
    vs = v[order]
    is_start = np.ones(v.size, dtype=bool)
    is_start[1:] = vs[1:] != vs[:-1]
    return order, is_start, np.flatnonzero(is_start)


def _avg_ranks(a: np.ndarray) -> np.ndarray:
    """1-based ranks with ties given their mean rank; equals ``scipy.stats.rankdata(a)``
    (computed here to keep the slow ``scipy.stats`` import off every command's path)."""
    a = np.asarray(a, dtype=float).ravel()
    n = a.size
    order, _, starts = tie_groups(a)
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
        order, is_start, starts = tie_groups(v)
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
class SpearmanResult(ResultDict):
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
