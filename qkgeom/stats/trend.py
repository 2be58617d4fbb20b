"""The trend of one value over a model's training checkpoints (rises, peaks, decays)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from qkgeom.stats.common import ResultDict
from qkgeom.stats.rank_correlation import spearman


@dataclass
class TrendResult(ResultDict):
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
