"""What every part of the analysis shares: constants, the error type, frame helpers and
number formatting."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import polars as pl

from qkgeom.errors import QkgeomError

BASELINE_ARM = "none"
SUMMARIES = ("final", "mean", "all")
TREND_WINDOWS = ("start", "late", "collapse")  # or a progress value in [0, 1): parse_window
LEVELS = ("trajectory", "run")
DEFAULT_LAST_PROBES = 3  # paired deltas average each trial's last N probes (--window N)
# The paper's predictions, arm -> sign of (arm - baseline) for entropy and key PR.
PREDICTED_SIGN = {"shrink": -1, "shrink_act": -1, "hold": 1}


class AnalysisError(QkgeomError):
    """The database lacks the data a statistic needs."""


def wide(df: pl.DataFrame, metrics: list[str], index: list[str]) -> pl.DataFrame:
    """Long metric rows to one column per metric (missing combinations dropped)."""
    w = df.pivot(on="metric", index=index, values="value", aggregate_function="mean")
    for m in metrics:
        if m not in w.columns:
            w = w.with_columns(pl.lit(None, dtype=pl.Float64).alias(m))
    return w.drop_nulls(metrics)


def require_rows(df: pl.DataFrame, sweep: str, metrics: list[str], what: str) -> None:
    if df.height == 0:
        raise AnalysisError(f"sweep {sweep!r} has no layer-level {' and '.join(metrics)} "
                            f"values for {what}; were the trials probed (probe_every)?")


def unit_keys(level: str) -> list[str]:
    return ["depth", "init", "layer"] + (["trial_id", "seed"] if level == "run" else [])


def make_rng(seed: int, *extra: int) -> np.random.Generator:
    return np.random.default_rng([seed, *extra]) if extra else np.random.default_rng(seed)


def fmt(v: Any, digits: int = 4) -> str:
    """A compact, stable text form of a number for tables."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
            return f"{v:.{digits - 1}e}"
        return f"{v:.{digits}f}"
    return str(v)
