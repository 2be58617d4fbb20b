"""From the results database to the study's statistics: SQL in, plain results out.

Everything here reads the store's views through ``store.sql`` (polars frames), shapes
the data, and calls the pure functions of :mod:`qkgeom.stats`. Missing data raise
:class:`AnalysisError` saying what is missing and what to do.

Units of analysis
-----------------
* A *trajectory* is one (depth, init, layer) curve of the geometry trials (arm
  ``none``), averaged over seeds at each step (the paper's 54 for the full grid).
* A *run-level unit* is one (trial, layer) curve, no averaging.
* Layer-level rows only (head NULL): PR_Q / PR_K are then the PR of the heads
  concatenated, and per-head-by-nature metrics (entropy, qk_*) are the mean over heads.
* By default only trials with status ``terminated`` count (``finished_only``); a running
  trial's "final" probe is not the end of training.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

from qkgeom import stats
from qkgeom.errors import QkgeomError
from qkgeom.records import METRICS

BASELINE_ARM = "none"
SUMMARIES = ("final", "mean", "all")
WINDOWS = ("start", "collapse")  # or a progress value in [0, 1)
LEVELS = ("trajectory", "run")
DEFAULT_WINDOW = 3
# The paper's predictions, arm -> sign of (arm - baseline) for entropy and key PR.
PREDICTED_SIGN = {"shrink": -1, "shrink_act": -1, "hold": 1}
_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


class AnalysisError(QkgeomError):
    """The database lacks the data a statistic needs."""


# --------------------------------------------------------------------------- basics


def _q(name: str) -> str:
    """A metric/arm name as a SQL string literal (names are validated to be plain)."""
    if not _NAME.match(name):
        raise AnalysisError(f"invalid name {name!r}: use letters, digits, '_', '-' or '.'")
    return "'" + name + "'"


def _in(values: list[Any]) -> str:
    return "(" + ", ".join(_q(v) if isinstance(v, str) else str(int(v)) for v in values) + ")"


def _nan(df: pl.DataFrame, col: str = "value") -> pl.DataFrame:
    # The store writes NaN as NULL; numpy wants NaN.
    return df.with_columns(pl.col(col).cast(pl.Float64).fill_null(float("nan")))


def sweep_names(store: Any) -> list[str]:
    return store.sql("SELECT name FROM sweeps ORDER BY name")["name"].to_list()


def resolve_sweep(store: Any, sweep: str | None) -> str:
    """The sweep to analyse: ``sweep`` if it exists, else the only one in the database."""
    names = sweep_names(store)
    if sweep is None:
        if len(names) == 1:
            return names[0]
        if not names:
            raise AnalysisError("the database holds no sweeps yet; run one with "
                                "`qkgeom sweep` (or point --db at another database)")
        raise AnalysisError(f"the database holds {len(names)} sweeps; pick one with --sweep "
                            f"NAME: {', '.join(names)}")
    if sweep not in names:
        have = ", ".join(names) if names else "(none)"
        raise AnalysisError(f"no sweep named {sweep!r} in the database; existing sweeps: {have}")
    return sweep


def known_metrics(store: Any) -> list[str]:
    """Metric names this qkgeom defines plus those the database declares or holds."""
    names = set(METRICS)
    try:
        names |= set(store.sql("SELECT name FROM metric_definitions")["name"].to_list())
    except Exception:  # an older schema without the table: the record contract suffices
        pass
    return sorted(names)


def check_metric(store: Any, name: str) -> str:
    if name in METRICS:
        return name
    valid = known_metrics(store)
    if name not in valid:
        raise AnalysisError(f"unknown metric {name!r}; valid metrics: {', '.join(valid)}")
    return name


def trials(store: Any, sweep: str) -> pl.DataFrame:
    """One row per trial of ``sweep``: trial_id, depth, init, arm, seed, status."""
    return store.sql(
        "SELECT t.id AS trial_id, t.depth, t.init, t.arm, t.seed, t.status "
        "FROM trials t JOIN sweeps s ON s.id = t.sweep_id WHERE s.name = :sweep "
        "ORDER BY t.id", {"sweep": sweep})


def trial_rows(store: Any, sweep: str) -> list[dict[str, Any]]:
    """Every trial of ``sweep`` as a dict: trial_id, depth, init, arm, seed, status,
    test_loss (None until finished) and config (parsed)."""
    import json

    df = store.sql(
        "SELECT t.id AS trial_id, t.depth, t.init, t.arm, t.seed, t.status, t.test_loss, "
        "t.config FROM trials t JOIN sweeps s ON s.id = t.sweep_id WHERE s.name = :sweep "
        "ORDER BY t.id", {"sweep": sweep})
    rows = df.to_dicts()
    for r in rows:
        c = r["config"]
        r["config"] = json.loads(c) if isinstance(c, str) else (c or {})
        tl = r["test_loss"]
        r["test_loss"] = None if tl is None or (isinstance(tl, float) and math.isnan(tl)) \
            else float(tl)
    return rows


# (config key, label) of what the report states about a study's scale and optimiser
SCALE_KEYS = [("n_embd", "width n_embd"), ("n_head", "heads"), ("block_size", "context"),
              ("max_steps", "training steps"), ("batch_size", "batch (sequences)"),
              ("lr", "peak lr"), ("min_lr", "lr floor (cosine)"), ("warmup", "warm-up steps"),
              ("weight_decay", "weight decay"), ("betas", "AdamW betas")]


def study_scale(store: Any, sweep: str, *, finished_only: bool = True) -> dict[str, Any]:
    """What a sweep ran: the distinct values of each :data:`SCALE_KEYS` setting over its
    trials, the grid depths and seeds, and the seeds of every arm."""
    rows = trial_rows(store, sweep)
    if finished_only:
        rows = [r for r in rows if r["status"] == "terminated"] or rows
    out: dict[str, Any] = {}
    for key, _ in SCALE_KEYS:
        vals = set()
        for r in rows:
            c = r["config"]
            if key == "warmup":
                frac = float(c.get("warmup_frac") or 0.0)
                v = (int(round(frac * c["max_steps"])) if frac > 0 and "max_steps" in c
                     else c.get("warmup_steps"))
            elif key == "betas":
                v = (c.get("beta1"), c.get("beta2")) if "beta1" in c else None
            else:
                v = c.get(key)
            if v is not None:
                vals.add(v)
        out[key] = sorted(vals, key=str)
    grid = [r for r in rows if r["arm"] == BASELINE_ARM]
    out["depths"] = sorted({r["depth"] for r in grid})
    out["inits"] = sorted({r["init"] for r in grid})
    out["grid_seeds"] = sorted({r["seed"] for r in grid})
    out["arm_seeds"] = {a: sorted({r["seed"] for r in rows if r["arm"] == a})
                        for a in sorted({r["arm"] for r in rows} - {BASELINE_ARM})}
    out["n_trials"] = len(rows)
    return out


def test_loss_pairs(store: Any, sweep: str, *, arm: str, baseline: str = BASELINE_ARM
                    ) -> list[dict[str, Any]]:
    """Final test loss of each finished ``arm`` trial beside its paired baseline (same
    depth, init and seed): depth, init, seed, arm_test_loss, baseline_test_loss."""
    rows = [r for r in trial_rows(store, sweep) if r["status"] == "terminated"]
    base = {(r["depth"], r["init"], r["seed"]): r["test_loss"] for r in rows
            if r["arm"] == baseline}
    return [{"depth": r["depth"], "init": r["init"], "seed": r["seed"],
             "arm_test_loss": r["test_loss"],
             "baseline_test_loss": base.get((r["depth"], r["init"], r["seed"]))}
            for r in rows if r["arm"] == arm]


def _select_trials(store: Any, sweep: str, *, arms: list[str] | None = None,
                   depth: int | None = None, init: str | None = None,
                   finished_only: bool = True) -> pl.DataFrame:
    t = trials(store, sweep)
    if t.height == 0:
        raise AnalysisError(f"sweep {sweep!r} has no trials yet; run it with "
                            f"`qkgeom sweep` first")
    what = []
    if arms is not None:
        t = t.filter(pl.col("arm").is_in(arms))
        what.append(f"arm {'/'.join(arms)}")
    if depth is not None:
        depths = sorted(set(t["depth"].to_list()))
        t = t.filter(pl.col("depth") == depth)
        if t.height == 0:
            raise AnalysisError(f"sweep {sweep!r} has no trials at depth {depth}; depths "
                                f"present: {', '.join(map(str, depths)) or '(none)'}")
    if init is not None:
        inits = sorted(set(t["init"].to_list()))
        t = t.filter(pl.col("init") == init)
        if t.height == 0:
            raise AnalysisError(f"sweep {sweep!r} has no trials with init {init!r}; inits "
                                f"present: {', '.join(inits) or '(none)'}")
    if t.height == 0:
        raise AnalysisError(f"sweep {sweep!r} has no trials with {', '.join(what)}")
    if finished_only:
        done = t.filter(pl.col("status") == "terminated")
        if done.height == 0:
            counts = ", ".join(f"{s} {n}" for s, n in
                               t.group_by("status").len().sort("status").iter_rows())
            raise AnalysisError(
                f"none of the {t.height} matching trials of sweep {sweep!r} has finished "
                f"(status: {counts}); wait for them, or pass --include-unfinished to "
                "analyse partial runs")
        t = done
    return t


def layer_values(store: Any, trial_ids: list[int], metrics: list[str]) -> pl.DataFrame:
    """Layer-level rows: trial_id, step, progress, layer, metric, value (NaN for NULL)."""
    if not trial_ids:
        return pl.DataFrame(schema={"trial_id": pl.Int64, "step": pl.Int64,
                                    "progress": pl.Float64, "layer": pl.Int64,
                                    "metric": pl.String, "value": pl.Float64})
    df = store.sql(
        "SELECT trial_id, step, progress, layer, metric, value FROM v_layer_metrics "
        f"WHERE metric IN {_in(metrics)} AND trial_id IN {_in(trial_ids)}")
    return _nan(df.with_columns(pl.col("progress").cast(pl.Float64)))


def _wide(df: pl.DataFrame, metrics: list[str], index: list[str]) -> pl.DataFrame:
    """Long metric rows to one column per metric (missing combinations dropped)."""
    w = df.pivot(on="metric", index=index, values="value", aggregate_function="mean")
    for m in metrics:
        if m not in w.columns:
            w = w.with_columns(pl.lit(None, dtype=pl.Float64).alias(m))
    return w.drop_nulls(metrics)


def _require_rows(df: pl.DataFrame, sweep: str, metrics: list[str], what: str) -> None:
    if df.height == 0:
        raise AnalysisError(f"sweep {sweep!r} has no layer-level {' and '.join(metrics)} "
                            f"values for {what}; were the trials probed (probe_every)?")


# --------------------------------------------------------------------------- PR gap


def pr_gap_units(store: Any, sweep: str, *, level: str = "trajectory",
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
    t = _select_trials(store, sweep, arms=[arm], depth=depth, init=init,
                       finished_only=finished_only)
    ids = t["trial_id"].to_list()
    rows = (layer_values(store, ids, ["pr_q", "pr_k"]) if values is None else
            values.filter(pl.col("trial_id").is_in(ids) & pl.col("metric").is_in(["pr_q", "pr_k"])))
    w = _wide(rows, ["pr_q", "pr_k"], ["trial_id", "step", "progress", "layer"])
    _require_rows(w, sweep, ["pr_q", "pr_k"], f"arm {arm!r}")
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


def unit_keys(level: str) -> list[str]:
    return ["depth", "init", "layer"] + (["trial_id", "seed"] if level == "run" else [])


# --------------------------------------------------------------------------- trend windows


def parse_window(value: str | float) -> str | float:
    """``start``, ``collapse`` or a training progress in [0, 1) (``--from``)."""
    if isinstance(value, str) and value in WINDOWS:
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
    if window == "collapse":
        return ("from the end of the initial collapse (per unit: the probe with the lowest "
                f"PR_Q + PR_K at progress <= {stats.COLLAPSE_SEARCH:g})")
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

    ``start``: every probe; ``collapse``: the probes at and after the unit's collapse
    point; a float ``f``: the probes with progress >= f.
    """
    window = parse_window(window)
    if window == "start":
        return units, None
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
        return {"sweep": self.sweep, "level": self.level, "summary": self.summary,
                "window": self.window, "window_label": window_label(self.window),
                "collapse": self.collapse,
                "statistic": "PR_Q - PR_K", **self.result.to_dict(),
                "by_depth_init": self.by_cell.to_dicts()}


def sign_test(store: Any, sweep: str, *, summary: str = "final", level: str = "trajectory",
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
    by_cell = pl.DataFrame(cells).sort(["depth", "init"])
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
        d: dict[str, Any] = {"sweep": self.sweep, "level": self.level,
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


def slopes(store: Any, sweep: str, *, level: str = "trajectory", depth: int | None = None,
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


# --------------------------------------------------------------------------- interventions


def arms_summary(store: Any, sweep: str) -> pl.DataFrame:
    """Trials per (arm, depth, init, status)."""
    return trials(store, sweep).group_by(["arm", "depth", "init", "status"]).len().sort(
        ["arm", "depth", "init", "status"])


@dataclass
class PairedDeltas:
    """Per-seed paired differences arm - baseline of one metric at the end of training."""

    sweep: str
    arm: str
    baseline: str
    metric: str
    window: int
    table: pl.DataFrame  # depth, init, seed, arm_value, baseline_value, delta, ...
    per_layer: pl.DataFrame | None  # depth, init, seed, layer, arm_value, ..., delta
    notes: list[str] = field(default_factory=list)


def _last_window(values: pl.DataFrame, window: int, by_layer: bool) -> pl.DataFrame:
    """Mean per trial (and layer) over the trial's last ``window`` probe steps."""
    steps = (values.select("trial_id", "step").unique()
             .with_columns(pl.col("step").rank("dense", descending=True).over("trial_id")
                           .alias("_r"))
             .filter(pl.col("_r") <= window).drop("_r"))
    v = values.join(steps, on=["trial_id", "step"])
    keys = ["trial_id"] + (["layer"] if by_layer else [])
    # NaN rows (metric failed) are ignored by the mean rather than poisoning it
    return v.with_columns(pl.col("value").fill_nan(None)).group_by(keys).agg(
        pl.col("value").mean(), pl.col("step").max().alias("last_step"),
        pl.col("step").n_unique().alias("n_steps")).with_columns(
        pl.col("value").fill_null(float("nan")))


def paired_deltas(store: Any, sweep: str, *, arm: str, baseline: str = BASELINE_ARM,
                  metric: str = "entropy", window: int = DEFAULT_WINDOW,
                  per_layer: bool = False, finished_only: bool = True,
                  values: pl.DataFrame | None = None) -> PairedDeltas:
    """Per seed, ``metric(arm) - metric(baseline)``, each the mean over the trial's last
    ``window`` probes and over layers; paired by (depth, init, seed).

    The baseline of a seed is every ``baseline``-arm trial at the arm's depth, init and
    seed (normally exactly one; several are averaged and noted). ``values``: layer rows
    already read (see :func:`intervention_values`), to avoid reading them again.
    """
    check_metric(store, metric)
    if window < 1:
        raise AnalysisError(f"--window must be at least 1 probe, got {window}")
    t_all = trials(store, sweep)
    arms_present = sorted(set(t_all["arm"].to_list()))
    interventions = [a for a in arms_present if a != baseline]
    if not interventions:
        raise AnalysisError(
            f"sweep {sweep!r} has no intervention arms (only arm {baseline!r}, "
            f"{t_all.height} trials); run an intervention sweep with arms hold/shrink")
    if arm not in arms_present:
        raise AnalysisError(f"sweep {sweep!r} has no trials of arm {arm!r}; arms present: "
                            f"{', '.join(arms_present)}")
    if arm == baseline:
        raise AnalysisError(f"--arm and --baseline are both {arm!r}; compare two arms")
    t = _select_trials(store, sweep, arms=[arm, baseline], finished_only=finished_only)
    t_arm = t.filter(pl.col("arm") == arm)
    if t_arm.height == 0:
        raise AnalysisError(f"no finished trials of arm {arm!r} in sweep {sweep!r}; wait for "
                            "them or pass --include-unfinished")
    cells = t_arm.select("depth", "init").unique()
    t_base = t.filter(pl.col("arm") == baseline).join(cells, on=["depth", "init"])
    if values is None:
        vals = layer_values(store, t["trial_id"].to_list(), [metric])
    else:
        vals = values.filter((pl.col("metric") == metric)
                             & pl.col("trial_id").is_in(t["trial_id"].to_list()))
    if vals.height == 0:
        raise AnalysisError(f"sweep {sweep!r} has no layer-level {metric!r} values for arms "
                            f"{arm!r}/{baseline!r}; were the trials probed?")
    notes: list[str] = []

    def pair(by_layer: bool) -> pl.DataFrame:
        end = _last_window(vals, window, by_layer)
        keys = ["depth", "init", "seed"] + (["layer"] if by_layer else [])

        def side(tt: pl.DataFrame, name: str) -> pl.DataFrame:
            return end.join(tt.select("trial_id", "depth", "init", "seed"), on="trial_id") \
                .group_by(keys).agg(pl.col("value").mean().alias(f"{name}_value"),
                                    pl.col("trial_id").n_unique().alias(f"{name}_trials"),
                                    pl.col("last_step").max().alias(f"{name}_last_step"))
        a = side(t_arm, "arm")
        b = side(t_base, "baseline")
        return a.join(b, on=keys, how="inner").with_columns(
            (pl.col("arm_value") - pl.col("baseline_value")).alias("delta")).sort(keys)

    table = pair(False)
    a_seeds = sorted(set(t_arm["seed"].to_list()))
    b_seeds = sorted(set(t_base["seed"].to_list()))
    n_ok = table.filter(pl.col("delta").is_finite()).height
    if n_ok < 2:
        cells_s = ", ".join(f"depth {d} init {i}" for d, i in cells.sort(["depth", "init"])
                            .iter_rows())
        raise AnalysisError(
            f"too few seeds to pair arm {arm!r} with baseline {baseline!r} at {cells_s}: "
            f"arm {arm!r} has {len(a_seeds)} seeds {a_seeds}, baseline {baseline!r} has "
            f"{len(b_seeds)} seeds {b_seeds}; {n_ok} paired with a finite {metric}, "
            "need at least 2 (run the missing seeds)")
    unpaired = sorted(set(a_seeds) ^ set(b_seeds))
    if unpaired:
        notes.append(f"seeds without a partner, left out: {unpaired}")
    multi = table.filter(pl.col("baseline_trials") > 1)
    if multi.height:
        notes.append(f"{multi.height} seeds have several {baseline!r} trials; their values "
                     "were averaged")
    mism = table.filter(pl.col("arm_last_step") != pl.col("baseline_last_step"))
    if mism.height:
        notes.append(f"{mism.height} pairs end at different steps (arm vs baseline), e.g. "
                     f"seed {mism['seed'][0]}: {mism['arm_last_step'][0]} vs "
                     f"{mism['baseline_last_step'][0]}")
    return PairedDeltas(sweep, arm, baseline, metric, window, table,
                        pair(True) if per_layer else None, notes)


def intervention_values(store: Any, sweep: str, *, arm: str, baseline: str,
                        metrics: list[str]) -> pl.DataFrame | None:
    """Layer rows of ``metrics`` for the arm's trials and the baseline trials in the arm's
    (depth, init) cells, read in one query (None when the arm has no trials)."""
    t = trials(store, sweep)
    a = t.filter(pl.col("arm") == arm)
    if a.height == 0:
        return None
    b = t.filter(pl.col("arm") == baseline).join(a.select("depth", "init").unique(),
                                                 on=["depth", "init"])
    return layer_values(store, a["trial_id"].to_list() + b["trial_id"].to_list(), metrics)


def default_sign(arm: str, predicted_sign: int | None) -> int:
    if predicted_sign is not None:
        if predicted_sign not in (-1, 1):
            raise AnalysisError(f"--predicted-sign must be -1 or 1, got {predicted_sign}")
        return predicted_sign
    if arm not in PREDICTED_SIGN:
        raise AnalysisError(f"no default prediction for arm {arm!r} (shrink predicts -1, "
                            "hold +1); pass --predicted-sign -1 or 1")
    return PREDICTED_SIGN[arm]


@dataclass
class DirectionalReport:
    deltas: PairedDeltas
    result: stats.DirectionalResult
    seed: int
    per_layer: list[dict[str, Any]] | None
    key_check: dict[str, Any] | None

    def to_dict(self) -> dict[str, Any]:
        p = self.deltas
        d: dict[str, Any] = {"sweep": p.sweep, "arm": p.arm, "baseline": p.baseline,
                             "metric": p.metric, "window": p.window, "seed": self.seed,
                             "ci_method": "BCa", **self.result.to_dict(),
                             "pairs": p.table.select("depth", "init", "seed", "arm_value",
                                                     "baseline_value", "delta").to_dicts(),
                             "notes": p.notes}
        if self.per_layer is not None:
            d["per_layer"] = self.per_layer
        if self.key_check is not None:
            d["key_check"] = self.key_check
        return d


def _rng(seed: int, *extra: int) -> np.random.Generator:
    return np.random.default_rng([seed, *extra]) if extra else np.random.default_rng(seed)


def key_check(store: Any, sweep: str, *, arm: str, baseline: str = BASELINE_ARM,
              window: int = DEFAULT_WINDOW, finished_only: bool = True,
              values: pl.DataFrame | None = None) -> dict[str, Any]:
    """Did the arm move the keys' geometry relative to the baseline, seed by seed?

    For the achieved W_K weight PR (``pr_wk``) and the key-activation PR (``pr_k``):
    mean arm and baseline values at the end of training, mean paired delta, and how many
    seeds moved down/up. Metrics with too few pairs are reported as missing.
    """
    out: dict[str, Any] = {}
    for m in ("pr_wk", "pr_k"):
        try:
            p = paired_deltas(store, sweep, arm=arm, baseline=baseline, metric=m,
                              window=window, finished_only=finished_only, values=values)
        except AnalysisError as e:
            out[m] = {"error": str(e)}
            continue
        d = p.table["delta"].to_numpy()
        d = d[np.isfinite(d)]
        out[m] = {"n_seeds": int(d.size),
                  "arm_mean": float(np.nanmean(p.table["arm_value"].to_numpy())),
                  "baseline_mean": float(np.nanmean(p.table["baseline_value"].to_numpy())),
                  "mean_delta": float(d.mean()), "n_lower": int((d < 0).sum()),
                  "n_higher": int((d > 0).sum()),
                  "relative_delta": float(d.mean() / np.nanmean(
                      p.table["baseline_value"].to_numpy()))}
    return out


def directional(store: Any, sweep: str, *, arm: str, baseline: str = BASELINE_ARM,
                metric: str = "entropy", window: int = DEFAULT_WINDOW,
                n_boot: int = stats.MIN_BOOT_DIRECTIONAL, seed: int = 0,
                predicted_sign: int | None = None, per_layer: bool = False,
                with_key_check: bool = True, finished_only: bool = True
                ) -> DirectionalReport:
    """Directional confidence of ``arm`` vs ``baseline`` on ``metric`` (see stats)."""
    if n_boot < stats.MIN_BOOT_DIRECTIONAL:
        raise AnalysisError(f"--boot must be at least {stats.MIN_BOOT_DIRECTIONAL} "
                            f"(the paper's B), got {n_boot}")
    check_metric(store, metric)
    metrics = list(dict.fromkeys([metric] + (["pr_wk", "pr_k"] if with_key_check else [])))
    values = intervention_values(store, sweep, arm=arm, baseline=baseline, metrics=metrics)
    p = paired_deltas(store, sweep, arm=arm, baseline=baseline, metric=metric,
                      window=window, per_layer=per_layer, finished_only=finished_only,
                      values=values)
    sign = default_sign(arm, predicted_sign)
    res = stats.directional_confidence(p.table["delta"].to_numpy(), predicted_sign=sign,
                                       n_boot=n_boot, rng=_rng(seed))
    layers = None
    if per_layer and p.per_layer is not None:
        layers = []
        for (layer,), part in p.per_layer.group_by(["layer"], maintain_order=True):
            d = part["delta"].to_numpy()
            if np.isfinite(d).sum() < 2:
                layers.append({"layer": layer, "n_seeds": int(np.isfinite(d).sum()),
                               "error": "fewer than 2 paired seeds"})
                continue
            r = stats.directional_confidence(d, predicted_sign=sign, n_boot=n_boot,
                                             rng=_rng(seed, int(layer) + 1))
            layers.append({"layer": layer, **{k: v for k, v in r.to_dict().items()
                                              if k not in ("deltas",)}})
        layers.sort(key=lambda x: x["layer"])
    kc = key_check(store, sweep, arm=arm, baseline=baseline, window=window,
                   finished_only=finished_only, values=values) if with_key_check else None
    return DirectionalReport(p, res, seed, layers, kc)


# --------------------------------------------------------------------------- correlations


def metric_points(store: Any, sweep: str, metrics: list[str], *, arm: str | None = None,
                  finished_only: bool = True) -> pl.DataFrame:
    """One row per (trial, probe, layer), one column per metric (null where missing):
    trial_id, depth, init, arm, seed, step, progress, layer, *metrics."""
    for m in metrics:
        check_metric(store, m)
    t = _select_trials(store, sweep, arms=None if arm is None else [arm],
                       finished_only=finished_only)
    rows = layer_values(store, t["trial_id"].to_list(), metrics)
    w = rows.pivot(on="metric", index=["trial_id", "step", "progress", "layer"], values="value",
                   aggregate_function="mean")
    for m in metrics:
        if m not in w.columns:
            w = w.with_columns(pl.lit(None, dtype=pl.Float64).alias(m))
    return w.join(t.select("trial_id", "depth", "init", "arm", "seed"), on="trial_id").select(
        "trial_id", "depth", "init", "arm", "seed", "step", "progress", "layer", *metrics).sort(
        ["trial_id", "step", "layer"])


def correlation_points(store: Any, sweep: str, *, x: str, y: str, arm: str | None = None,
                       finished_only: bool = True, points: pl.DataFrame | None = None
                       ) -> pl.DataFrame:
    """One row per (trial, probe, layer) with both metrics: trial_id, depth, init, arm,
    seed, step, progress, layer, ``x``, ``y``. ``points``: a :func:`metric_points` frame
    holding both columns, if already read."""
    check_metric(store, x)
    check_metric(store, y)
    if x == y:
        raise AnalysisError(f"--x and --y are both {x!r}; pick two different metrics")
    if points is None:
        points = metric_points(store, sweep, [x, y], arm=arm, finished_only=finished_only)
    keep = [c for c in points.columns if c not in METRICS or c in (x, y)]
    w = points.select(keep).drop_nulls([x, y])
    _require_rows(w, sweep, [x, y], "its trials")
    return w


@dataclass
class CorrelationReport:
    sweep: str
    x: str
    y: str
    overall: stats.SpearmanResult
    by_depth: list[dict[str, Any]]
    seed: int

    def to_dict(self) -> dict[str, Any]:
        return {"sweep": self.sweep, "x": self.x, "y": self.y, "method": "spearman",
                "unit": "one point per (trial, probe, layer)",
                "bootstrap": "cluster bootstrap over trials", "seed": self.seed,
                **self.overall.to_dict(), "by_depth": self.by_depth}


def correlate(store: Any, sweep: str, *, x: str, y: str, n_boot: int = 1000, seed: int = 0,
              arm: str | None = None, finished_only: bool = True,
              points: pl.DataFrame | None = None, depth_ci: bool = True) -> CorrelationReport:
    """Spearman of ``x`` vs ``y`` across probes and runs, overall and per depth.

    The CIs come from a cluster bootstrap over trials (:func:`stats.spearman_ci` with
    ``clusters`` = trial id): a resample keeps or repeats whole trials.

    ``points``: a :func:`correlation_points` frame, if already read. ``depth_ci=False``
    gives per-depth rho without a bootstrap CI (cheaper).
    """
    if n_boot < 100:
        raise AnalysisError(f"--boot must be at least 100 for a CI, got {n_boot}")
    pts = points if points is not None else correlation_points(
        store, sweep, x=x, y=y, arm=arm, finished_only=finished_only)
    import os
    from concurrent.futures import ThreadPoolExecutor

    parts = list(pts.group_by(["depth"], maintain_order=True))
    # The bootstraps (overall, then one per depth) are independent, each with its own
    # seeded generator, so they run on two threads (numpy releases the GIL in the
    # per-resample array work); results do not depend on the scheduling.
    jobs = [(pts, _rng(seed))] + ([(part, _rng(seed, int(depth))) for (depth,), part in parts]
                                  if depth_ci else [])
    with ThreadPoolExecutor(max_workers=min(2, os.cpu_count() or 1)) as ex:
        cis = list(ex.map(lambda j: stats.spearman_ci(
            j[0][x].to_numpy(), j[0][y].to_numpy(), clusters=j[0]["trial_id"].to_numpy(),
            n_boot=n_boot, rng=j[1]), jobs))
    overall = cis[0]
    by_depth = []
    for i, ((depth,), part) in enumerate(parts):
        if depth_ci:
            by_depth.append({"depth": depth, **cis[i + 1].to_dict()})
        else:
            by_depth.append({"depth": depth, "n": part.height,
                             "rho": stats.spearman(part[x].to_numpy(), part[y].to_numpy())})
    by_depth.sort(key=lambda r: r["depth"])
    return CorrelationReport(sweep, x, y, overall, by_depth, seed)


# --------------------------------------------------------------------------- pretrained


def pretrained_models(store: Any) -> pl.DataFrame:
    """model, n_checkpoints, first/last step (from ``pretrained_runs``)."""
    return store.sql(
        "SELECT model, COUNT(*) AS n_checkpoints, MIN(step) AS first_step, "
        "MAX(step) AS last_step FROM pretrained_runs GROUP BY model ORDER BY model")


@dataclass
class CheckpointTrendReport:
    model: str
    overall: stats.TrendResult  # PR_Q - PR_K averaged over layers, vs step
    by_layer: list[dict[str, Any]]
    link: dict[str, Any] | None  # Spearman of interaction rank vs entropy
    n_layers: int

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "statistic": "PR_Q - PR_K (layer-level, mean over "
                "layers for overall)", **self.overall.to_dict(), "n_layers": self.n_layers,
                "n_layers_rise_then_decay": sum(r["rises_then_decays"] for r in self.by_layer),
                "by_layer": self.by_layer, "rank_entropy_link": self.link}


def checkpoint_trend(store: Any, model: str, *, link_x: str = "qk_erank",
                     link_y: str = "entropy") -> CheckpointTrendReport:
    """Trend of PR_Q - PR_K over a pretrained model's checkpoints, per layer and overall.

    Rows come from ``v_pretrained`` (layer-level, head NULL). Checkpoints without a step
    (e.g. a final release) are left out of the trend. ``link`` is the Spearman of
    ``link_x`` vs ``link_y`` across checkpoints and layers (the paper's
    rank-entropy link), when both are present.
    """
    models = pretrained_models(store)
    names = models["model"].to_list()
    if model not in names:
        have = ", ".join(names) if names else "(none; measure one with `qkgeom probe-pretrained`)"
        raise AnalysisError(f"no pretrained model {model!r} in the database; models: {have}")
    df = _nan(store.sql(
        "SELECT revision, step, layer, metric, value FROM v_pretrained "
        f"WHERE model = :model AND head IS NULL AND metric IN "
        f"{_in(['pr_q', 'pr_k', link_x, link_y])}", {"model": model}))
    w = _wide(df.filter(pl.col("metric").is_in(["pr_q", "pr_k"])), ["pr_q", "pr_k"],
              ["revision", "step", "layer"])
    w = w.filter(pl.col("step").is_not_null()).with_columns(
        (pl.col("pr_q") - pl.col("pr_k")).alias("gap"))
    if w.height == 0:
        raise AnalysisError(f"model {model!r} has no layer-level pr_q/pr_k values at "
                            "checkpoints with a known step; measure its checkpoints first")
    per_step = w.group_by("step").agg(pl.col("gap").mean()).sort("step")
    overall = stats.checkpoint_trend(per_step["step"].to_numpy(), per_step["gap"].to_numpy())
    by_layer = []
    for (layer,), part in w.group_by(["layer"], maintain_order=True):
        p = part.group_by("step").agg(pl.col("gap").mean()).sort("step")
        r = stats.checkpoint_trend(p["step"].to_numpy(), p["gap"].to_numpy()).to_dict()
        by_layer.append({"layer": layer, **{k: v for k, v in r.items()
                                             if k not in ("steps", "values")}})
    by_layer.sort(key=lambda r: r["layer"])
    link = None
    lw = _wide(df.filter(pl.col("metric").is_in([link_x, link_y])), [link_x, link_y],
               ["revision", "layer"])
    if lw.height >= 3:
        r = stats.spearman_ci(lw[link_x].to_numpy(), lw[link_y].to_numpy(), n_boot=1000,
                              rng=_rng(0))
        link = {"x": link_x, "y": link_y, **r.to_dict()}
    return CheckpointTrendReport(model, overall, by_layer, link, int(w["layer"].n_unique()))


def verdict_p(p: float, alpha: float = 0.05) -> str:
    return "holds" if p < alpha else "does not hold"


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


# --------------------------------------------------------------------------- plot inputs


def trajectory_frame(store: Any, sweep: str, *, finished_only: bool = True,
                     units: pl.DataFrame | None = None) -> pl.DataFrame:
    """Long trajectories for plotting: depth, init, layer, metric (pr_q/pr_k), step,
    progress, value (mean over seeds), n_seeds."""
    u = units if units is not None else pr_gap_units(store, sweep, level="trajectory",
                                                     finished_only=finished_only)
    return u.unpivot(on=["pr_q", "pr_k"], index=["depth", "init", "layer", "step", "progress",
                                                  "n_seeds"],
                     variable_name="metric", value_name="value")


def intervention_frame(store: Any, sweep: str, *,
                       metrics: tuple[str, ...] = ("entropy", "pr_wk", "pr_k"),
                       baseline: str = BASELINE_ARM, finished_only: bool = True
                       ) -> pl.DataFrame:
    """Per trial and probe, each metric averaged over layers, for the intervention cells:
    depth, init, arm, seed, trial_id, step, progress, metric, value."""
    t_all = trials(store, sweep)
    arms = sorted(set(t_all["arm"].to_list()) - {baseline})
    if not arms:
        raise AnalysisError(
            f"sweep {sweep!r} has no intervention arms (only arm {baseline!r}, "
            f"{t_all.height} trials); run an intervention sweep with arms hold/shrink")
    t = _select_trials(store, sweep, finished_only=finished_only)
    cells = t.filter(pl.col("arm") != baseline).select("depth", "init").unique()
    t = t.join(cells, on=["depth", "init"])
    vals = layer_values(store, t["trial_id"].to_list(), list(metrics))
    if vals.height == 0:
        raise AnalysisError(f"sweep {sweep!r} has no {', '.join(metrics)} values for its "
                            "intervention trials")
    m = vals.with_columns(pl.col("value").fill_nan(None)).group_by(
        ["trial_id", "step", "metric"]).agg(pl.col("progress").mean(), pl.col("value").mean())
    return m.join(t.select("trial_id", "depth", "init", "arm", "seed"), on="trial_id").select(
        "depth", "init", "arm", "seed", "trial_id", "step", "progress", "metric", "value").sort(
        ["arm", "seed", "metric", "step"])
