"""Claim 3: Spearman correlations of two metrics across probes and runs, with a cluster
bootstrap over trials."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import polars as pl

from qkgeom import stats
from qkgeom.analysis.common import AnalysisError, make_rng, require_rows
from qkgeom.analysis.scope import scope_fields
from qkgeom.analysis.trials import check_metric, select_trials
from qkgeom.records import METRICS
from qkgeom.store.queries import layer_values, probe_losses

if TYPE_CHECKING:
    from qkgeom.store import Store


def metric_points(store: Store, sweep: str, metrics: list[str], *, arm: str | None = None,
                  finished_only: bool = True) -> pl.DataFrame:
    """One row per (trial, probe, layer), one column per metric (null where missing):
    trial_id, depth, init, arm, seed, step, progress, val_loss, layer, *metrics
    (val_loss: the trial's validation loss at that probe, NaN where not stored)."""
    for m in metrics:
        check_metric(store, m)
    t = select_trials(store, sweep, arms=None if arm is None else [arm],
                       finished_only=finished_only)
    rows = layer_values(store, t["trial_id"].to_list(), metrics)
    w = rows.pivot(on="metric", index=["trial_id", "step", "progress", "layer"], values="value",
                   aggregate_function="mean")
    for m in metrics:
        if m not in w.columns:
            w = w.with_columns(pl.lit(None, dtype=pl.Float64).alias(m))
    loss = probe_losses(store, t["trial_id"].to_list())
    return w.join(t.select("trial_id", "depth", "init", "arm", "seed"), on="trial_id").join(
        loss, on=["trial_id", "step"], how="left").with_columns(
        pl.col("val_loss").fill_null(float("nan"))).select(
        "trial_id", "depth", "init", "arm", "seed", "step", "progress", "val_loss", "layer",
        *metrics).sort(["trial_id", "step", "layer"])


def correlation_points(store: Store, sweep: str, *, x: str, y: str, arm: str | None = None,
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
    require_rows(w, sweep, [x, y], "its trials")
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
        return {**scope_fields(self.sweep), "x": self.x, "y": self.y, "method": "spearman",
                "unit": "one point per (trial, probe, layer)",
                "bootstrap": "cluster bootstrap over trials", "seed": self.seed,
                **self.overall.to_dict(), "by_depth": self.by_depth}


def correlate(store: Store, sweep: str, *, x: str, y: str, n_boot: int = 1000, seed: int = 0,
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
    jobs = [(pts, make_rng(seed))] + (
        [(part, make_rng(seed, int(depth))) for (depth,), part in parts] if depth_ci else [])
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


def matched_progress_correlation(points: pl.DataFrame, *, x: str, y: str, seed: int = 0,
                                 group: str = "depth") -> stats.StratifiedCorrelation:
    """Spearman of ``x`` and ``y`` across trials at the same training progress (the same
    validation loss reached, :func:`stats.rules.align_by_loss`), ``group`` and layer,
    pooled, with its one-sided trial-permutation p (:func:`stats.rules.trial_permutation_p`):
    a training-time trend, a layer profile or a trial's training speed that both metrics
    share cannot make it. Points without a validation loss are compared at the same step."""
    from qkgeom.stats import rules

    xs, ys = stratified_groups(points, x, y, group=group, align="loss")
    return rules.trial_permutation_p(xs, ys, rng=make_rng(seed, 3))


def stratified_groups(points: pl.DataFrame, x: str, y: str, *, group: str = "depth",
                      align: str = "step") -> tuple[list[Any], list[Any]]:
    """Per ``group`` value, ``x`` and ``y`` as arrays (trials, strata). ``align="step"``: a
    stratum is one (step, layer) present with both metrics in every trial of the group;
    ``"loss"``: one (progress level, layer), the metrics interpolated at levels of the
    validation loss every trial reached (:func:`stats.rules.align_by_loss`; a group whose
    trials' losses do not overlap is left out, one without losses stays at ``"step"``).
    Strata with a missing value in any trial are dropped."""
    import numpy as np

    from qkgeom.stats import rules

    xs, ys = [], []
    pts = points.drop_nulls([x, y]).filter(pl.col(x).is_finite() & pl.col(y).is_finite())
    for _, part in pts.group_by([group], maintain_order=True):
        n_t = part["trial_id"].n_unique()
        full = part.group_by(["step", "layer"]).agg(pl.col("trial_id").n_unique().alias("n")) \
            .filter(pl.col("n") == n_t).select("step", "layer")
        if align == "loss" and full.height:  # the steps with every layer, for alignment
            per = full.group_by("step").agg(pl.len().alias("k"))
            full = full.join(per.filter(pl.col("k") == per["k"].max()).select("step"),
                             on="step")
        part = part.join(full, on=["step", "layer"]).sort(["trial_id", "step", "layer"])
        if part.height == 0 or n_t < 2:
            continue
        n_s = part["step"].n_unique()
        n_l = part.height // (n_t * n_s)
        xa = np.asarray(part[x].to_numpy(), dtype=float).reshape(n_t, -1)
        ya = np.asarray(part[y].to_numpy(), dtype=float).reshape(n_t, -1)
        if align == "loss" and n_l and "val_loss" in part.columns and n_s >= 2:
            loss = np.asarray(part["val_loss"].to_numpy(), dtype=float).reshape(
                n_t, n_s, n_l)[:, :, 0]
            if np.isfinite(loss).any():
                al = rules.align_by_loss(xa.reshape(n_t, n_s, n_l), ya.reshape(n_t, n_s, n_l),
                                         loss)
                if al is None:
                    continue
                xa, ya = al
        ok = np.isfinite(xa).all(axis=0) & np.isfinite(ya).all(axis=0)
        xs.append(xa[:, ok])
        ys.append(ya[:, ok])
    return xs, ys
