"""The study's statistics: pure numpy/scipy functions over plain arrays.

Modules: :mod:`~qkgeom.stats.effects` (sign tests, slopes, the initial collapse,
bootstrap directional confidence), :mod:`~qkgeom.stats.rank_correlation` (Spearman and its
point and cluster bootstrap CIs), :mod:`~qkgeom.stats.trend` (checkpoint trends); every
public name is importable from ``qkgeom.stats``.

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

from qkgeom.stats.common import ResultDict, binom_tail_half, finite_values
from qkgeom.stats.effects import (
    COLLAPSE_SEARCH,
    MIN_BOOT_DIRECTIONAL,
    DirectionalResult,
    SignTestResult,
    SlopesResult,
    bca_interval,
    bootstrap_means,
    collapse_index,
    directional_confidence,
    ols_line,
    sign_test,
    slopes,
)
from qkgeom.stats.rank_correlation import SpearmanResult, spearman, spearman_ci
from qkgeom.stats.rules import SplitTrend, StratifiedCorrelation, StratifiedLink
from qkgeom.stats.trend import TrendResult, checkpoint_trend

__all__ = [
    "COLLAPSE_SEARCH", "MIN_BOOT_DIRECTIONAL", "DirectionalResult", "ResultDict",
    "SignTestResult", "SlopesResult", "SpearmanResult", "SplitTrend", "StratifiedCorrelation",
    "StratifiedLink", "TrendResult", "bca_interval",
    "binom_tail_half", "bootstrap_means", "checkpoint_trend", "collapse_index",
    "directional_confidence", "finite_values", "ols_line", "sign_test", "slopes", "spearman",
    "spearman_ci",
]
