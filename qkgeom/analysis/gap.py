"""Claim 2: the sign of PR_Q - PR_K and the slopes of PR_Q and PR_K over training, from
step 0 or over a trend window (from the end of the initial collapse, or from a progress)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl

from qkgeom import stats
from qkgeom.analysis.common import (
    BASELINE_ARM,
    LEVELS,
    SUMMARIES,
    TREND_WINDOWS,
    AnalysisError,
    require_rows,
    unit_keys,
    wide,
)
from qkgeom.analysis.scope import scope_fields
from qkgeom.analysis.trials import select_trials
from qkgeom.stats.rules import LATE_FROM
from qkgeom.store.queries import layer_values

if TYPE_CHECKING:
    from qkgeom.store import Store


def pr_gap_units(store: Store, sweep: str, *, level: str = "trajectory",
                 depth: int | None = None, init: str | None = None, arm: str = BASELINE_ARM,
                 finished_only: bool = True, values: pl.DataFrame | None = None
                 ) -> pl.DataFrame:
    """PR_Q, PR_K and their gap per unit and step.

    Columns: unit columns (depth, init, layer, plus trial_id and seed at run level), step,
    progress, pr_q, pr_k, gap (= pr_q - pr_k), n_seeds. At trajectory level each value is
    the mean over seeds at that step (seeds missing a step are simply absent).
    ``values``: pr_q/pr_k layer rows already read (a superset is fine), to avoid a re-read.
    """
    if level not in LEVELS:
        raise AnalysisError(f"unknown level {level!r}; use one of {', '.join(LEVELS)}")
    t = select_trials(store, sweep, arms=[arm], depth=depth, init=init,
                       finished_only=finished_only)
    ids = t["trial_id"].to_list()
    rows = (layer_values(store, ids, ["pr_q", "pr_k"]) if values is None else
            values.filter(pl.col("trial_id").is_in(ids)
                          & pl.col("metric").is_in(["pr_q", "pr_k"])))
    w = wide(rows, ["pr_q", "pr_k"], ["trial_id", "step", "progress", "layer"])
    require_rows(w, sweep, ["pr_q", "pr_k"], f"arm {arm!r}")
    w = w.join(t.select("trial_id", "depth", "init", "seed"), on="trial_id")
    if level == "run":
        out = w.with_columns(pl.lit(1).alias("n_seeds"))
        keys = ["depth", "init", "layer", "trial_id", "seed"]
    else:
        keys = ["depth", "init", "layer"]
        out = w.group_by([*keys, "step"]).agg(
            pl.col("progress").mean(), pl.col("pr_q").mean(), pl.col("pr_k").mean(),
            pl.col("seed").n_unique().alias("n_seeds"))
    out = out.with_columns((pl.col("pr_q") - pl.col("pr_k")).alias("gap"))
    return out.select([*keys, "step", "progress", "pr_q", "pr_k", "gap", "n_seeds"]).sort(
        [*keys, "step"])


# --------------------------------------------------------------------------- trend windows


def parse_window(value: str | float) -> str | float:
    """``start``, ``collapse`` or a training progress in [0, 1) (``--from``)."""
    if isinstance(value, str) and value in TREND_WINDOWS:
        return value
    try:
        f = float(value)
    except (TypeError, ValueError):
        f = math.nan
    if not 0 <= f < 1:
        raise AnalysisError(f"--from {value!r}: use start, collapse, or a training progress "
                            "in [0, 1) such as 0.2")
    return f


def window_label(window: str | float) -> str:
    if window == "start":
        return "from step 0"
    if window == "late":
        return (f"from progress {LATE_FROM:g} (pre-specified: after the warm-up and the "
                "initial collapse, not chosen from the values tested)")
    if window == "collapse":
        return ("from the end of the initial collapse (per unit: the probe with the lowest "
                f"PR_Q + PR_K at progress <= {stats.COLLAPSE_SEARCH:g}; descriptive only: a "
                "window starting at a trajectory's own minimum biases later slopes upward)")
    return f"from progress {float(window):g}"


def collapse_points(units: pl.DataFrame, *, level: str) -> pl.DataFrame:
    """Per unit, the end of its initial collapse (:func:`qkgeom.stats.collapse_index` of
    PR_Q + PR_K against progress). Columns: unit keys, collapse_step, collapse_progress."""
    keys = unit_keys(level)
    g = units.sort([*keys, "step"]).group_by(keys, maintain_order=True).agg(
        pl.col("step"), pl.col("progress"), (pl.col("pr_q") + pl.col("pr_k")).alias("total"))
    rows = []
    for r in g.iter_rows(named=True):
        i = stats.collapse_index(r["progress"], r["total"])
        rows.append({**{k: r[k] for k in keys},
                     "collapse_step": r["step"][i] if i >= 0 else None,
                     "collapse_progress": float(r["progress"][i]) if i >= 0 else None})
    schema = {k: units.schema[k] for k in keys} | {"collapse_step": pl.Int64,
                                                   "collapse_progress": pl.Float64}
    return pl.DataFrame(rows, schema=schema, orient="row" if not rows else None)


def window_units(units: pl.DataFrame, window: str | float, *, level: str
                 ) -> tuple[pl.DataFrame, pl.DataFrame | None]:
    """The probes of each unit inside a trend window, and the collapse points (or None).

    ``start``: every probe; ``late``: the probes with progress >= :data:`LATE_FROM` (the
    verdicts' window); ``collapse``: the probes at and after the unit's collapse point; a
    float ``f``: the probes with progress >= f.
    """
    window = parse_window(window)
    if window == "start":
        return units, None
    if window == "late":
        return units.filter(pl.col("progress") >= LATE_FROM - 1e-12), None
    if window == "collapse":
        cp = collapse_points(units, level=level)
        keys = unit_keys(level)
        w = units.join(cp.select(*keys, "collapse_step"), on=keys).filter(
            pl.col("step") >= pl.col("collapse_step")).drop("collapse_step")
        return w, cp
    return units.filter(pl.col("progress") >= float(window) - 1e-12), None


def collapse_summary(cp: pl.DataFrame | None) -> dict[str, Any] | None:
    """Where the collapse points lie: n units, min / median / max step and progress."""
    if cp is None or cp.height == 0:
        return None
    st = cp["collapse_step"].drop_nulls().to_numpy()
    pr = cp["collapse_progress"].drop_nulls().to_numpy()
    if st.size == 0:
        return {"n": 0}
    return {"n": int(st.size), "search_progress": stats.COLLAPSE_SEARCH,
            "step_min": int(st.min()), "step_median": float(np.median(st)),
            "step_max": int(st.max()), "progress_median": float(np.median(pr))}


def summarise_gap(units: pl.DataFrame, *, summary: str, level: str) -> pl.DataFrame:
    """One summary value per unit: ``final`` (gap at the last probe), ``mean`` (mean gap
    over probes after step 0), ``all`` (min gap over probes after step 0, positive exactly
    when every probe after step 0 is positive). Columns: unit keys, value, n_probes,
    last_step."""
    if summary not in SUMMARIES:
        raise AnalysisError(f"unknown summary {summary!r}; use one of {', '.join(SUMMARIES)}")
    keys = unit_keys(level)
    g = units.sort([*keys, "step"])
    if summary == "final":
        agg = [pl.col("gap").last().alias("value")]
    else:
        after = g.filter(pl.col("step") > 0)
        g = after if after.height else g
        agg = [pl.col("gap").mean().alias("value") if summary == "mean"
               else pl.col("gap").min().alias("value")]
    return g.group_by(keys).agg(*agg, pl.len().alias("n_probes"),
                                pl.col("step").max().alias("last_step")).sort(keys)


@dataclass
class SignTestReport:
    sweep: str
    level: str
    summary: str
    result: stats.SignTestResult
    by_cell: pl.DataFrame  # depth, init, n, n_positive, p_value
    units: pl.DataFrame  # the per-unit summaries
    window: str | float = "start"
    collapse: dict[str, Any] | None = None  # where the collapse points lie (window collapse)

    def to_dict(self) -> dict[str, Any]:
        return {**scope_fields(self.sweep), "level": self.level, "summary": self.summary,
                "window": self.window, "window_label": window_label(self.window),
                "collapse": self.collapse,
                "statistic": "PR_Q - PR_K", **self.result.to_dict(),
                "by_depth_init": self.by_cell.to_dicts()}


def sign_test(store: Store, sweep: str, *, summary: str = "final", level: str = "trajectory",
              depth: int | None = None, init: str | None = None,
              finished_only: bool = True, units: pl.DataFrame | None = None,
              window: str | float = "start") -> SignTestReport:
    """One-sided exact sign test that PR_Q - PR_K > 0 over trajectories or runs.

    ``units``: the output of :func:`pr_gap_units` at this level, if already computed.
    ``window`` (see :func:`window_units`) restricts the probes the ``mean`` and ``all``
    summaries use; ``final`` is the last probe in every window.
    """
    if units is None:
        units = pr_gap_units(store, sweep, level=level, depth=depth, init=init,
                             finished_only=finished_only)
    window = parse_window(window)
    units, cp = window_units(units, window, level=level)
    s = summarise_gap(units, summary=summary, level=level)
    res = stats.sign_test(s["value"].to_numpy())
    cells = []
    for (d, i), part in s.group_by(["depth", "init"], maintain_order=True):
        r = stats.sign_test(part["value"].to_numpy())
        cells.append(dict(depth=d, init=i, n=r.n, n_positive=r.n_positive,
                          n_zero=r.n_zero, p_value=r.p_value))
    by_cell = pl.DataFrame(cells, schema={  # empty when the window holds no probe yet
        "depth": pl.Int64, "init": pl.String, "n": pl.Int64, "n_positive": pl.Int64,
        "n_zero": pl.Int64, "p_value": pl.Float64}).sort(["depth", "init"])
    return SignTestReport(sweep, level, summary, res, by_cell, s, window, collapse_summary(cp))


# --------------------------------------------------------------------------- slopes


@dataclass
class SlopesReport:
    sweep: str
    level: str
    pr_q: stats.SlopesResult
    pr_k: stats.SlopesResult
    gap: stats.SlopesResult
    table: pl.DataFrame  # unit keys, [collapse_step,] slope_pr_q, slope_pr_k, slope_gap, ...
    by_cell: pl.DataFrame  # depth, init, n, mean slopes
    window: str | float = "start"
    collapse: dict[str, Any] | None = None

    def to_dict(self, *, with_table: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = {**scope_fields(self.sweep), "level": self.level,
                             "unit": "value per unit of training progress (step/max_steps)",
                             "window": self.window, "window_label": window_label(self.window),
                             "collapse": self.collapse}
        for name in ("pr_q", "pr_k", "gap"):
            r = getattr(self, name).to_dict()
            r.pop("slopes")
            r.pop("intercepts")
            d[name] = r
        d["by_depth_init"] = self.by_cell.to_dicts()
        if with_table:
            d["slopes"] = self.table.to_dicts()
        return d


def slopes(store: Store, sweep: str, *, level: str = "trajectory", depth: int | None = None,
           init: str | None = None, finished_only: bool = True,
           units: pl.DataFrame | None = None, window: str | float = "start") -> SlopesReport:
    """Least-squares slopes of PR_Q, PR_K (and their gap) against progress per unit, over
    the probes inside ``window`` (see :func:`window_units`). A unit with fewer than two
    probes in its window has slope NaN (counted in ``n_undefined``)."""
    if units is None:
        units = pr_gap_units(store, sweep, level=level, depth=depth, init=init,
                             finished_only=finished_only)
    window = parse_window(window)
    units, cp = window_units(units, window, level=level)
    keys = unit_keys(level)
    grouped = units.group_by(keys, maintain_order=True).agg(
        pl.col("progress"), pl.col("pr_q"), pl.col("pr_k"), pl.col("gap"),
        pl.len().alias("n_probes")).sort(keys)
    prog = grouped["progress"].to_list()
    res = {m: stats.slopes(prog, grouped[m].to_list()) for m in ("pr_q", "pr_k", "gap")}
    table = grouped.select(keys + ["n_probes"]).with_columns(
        pl.Series("slope_pr_q", res["pr_q"].slopes, dtype=pl.Float64),
        pl.Series("slope_pr_k", res["pr_k"].slopes, dtype=pl.Float64),
        pl.Series("slope_gap", res["gap"].slopes, dtype=pl.Float64))
    if cp is not None:
        table = table.join(cp, on=keys, how="left").select(
            *keys, "collapse_step", "n_probes", "slope_pr_q", "slope_pr_k", "slope_gap")
    by_cell = table.group_by(["depth", "init"]).agg(
        pl.len().alias("n"), pl.col("slope_pr_q").mean().alias("mean_slope_pr_q"),
        pl.col("slope_pr_k").mean().alias("mean_slope_pr_k"),
        (pl.col("slope_pr_q") > 0).mean().alias("share_pr_q_up"),
        (pl.col("slope_pr_k") < 0).mean().alias("share_pr_k_down")).sort(["depth", "init"])
    return SlopesReport(sweep, level, res["pr_q"], res["pr_k"], res["gap"], table, by_cell,
                        window, collapse_summary(cp))


# --------------------------------------------------------------------------- plot inputs


def trajectory_frame(store: Store, sweep: str, *, finished_only: bool = True,
                     units: pl.DataFrame | None = None) -> pl.DataFrame:
    """Long trajectories for plotting: depth, init, layer, metric (pr_q/pr_k), step,
    progress, value (mean over seeds), n_seeds."""
    u = units if units is not None else pr_gap_units(store, sweep, level="trajectory",
                                                     finished_only=finished_only)
    return u.unpivot(on=["pr_q", "pr_k"], index=["depth", "init", "layer", "step", "progress",
                                                  "n_seeds"],
                     variable_name="metric", value_name="value")
