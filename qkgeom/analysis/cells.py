"""A cell at a glance: what it ran and how it ended, beside its verdicts.

The facts a comparison of cells (the scale x learning-rate ladder of docs/findings.md) puts
in its tables next to the verdicts: trials and how many terminated, the time they took,
the mean held-out loss per arm, claim 2's gap at the last probe seed by seed, and the last
layer's PR_Q and PR_K per depth. All of it from stored rows; nothing is recomputed from
weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import polars as pl

from qkgeom.analysis.common import BASELINE_ARM, AnalysisError
from qkgeom.analysis.gap import pr_gap_units, summarise_gap
from qkgeom.analysis.scope import Scope
from qkgeom.analysis.trials import grid_seed_list, sweep_trials

if TYPE_CHECKING:
    from qkgeom.store import Store


def grid_seeds(t: pl.DataFrame) -> list[int]:
    """Seeds of the geometry grid: those of arm ``none`` present in every (depth, init) of
    that arm (the extra baselines of the arms, one (depth, init) only, are not)."""
    g = t.filter(pl.col("arm") == BASELINE_ARM)
    return grid_seed_list(g.select("seed", "depth", "init").iter_rows())


def cell_facts(store: Store, scope: str | Scope, *, finished_only: bool = True
               ) -> dict[str, Any]:
    """The facts of one cell: ``trials``, ``terminated``, ``trial_s`` (the summed running
    time of its terminated trials, seconds), ``span_s`` (first start to last end, which
    includes pauses between resumed runs), ``test_loss`` (arm -> mean over terminated
    trials), ``grid_seeds``, ``gap_per_seed`` (seed -> [PR_Q > PR_K count, n] over the
    (trial, layer) units at the last probe) and ``last_layer`` (depth -> mean pr_q, mean pr_k,
    q_gt_k, n over the grid seeds' runs)."""
    t = sweep_trials(store, scope, "test_loss", "started_at", "ended_at")
    done = t.filter(pl.col("status") == "terminated")
    dur = done.select((pl.col("ended_at") - pl.col("started_at")).dt.total_seconds()
                      ).to_series().drop_nulls()
    out: dict[str, Any] = {
        "trials": t.height, "terminated": done.height,
        "trial_s": float(dur.sum()) if dur.len() else None,
        "span_s": ((t["ended_at"].max() - t["started_at"].min()).total_seconds()
                   if t["ended_at"].max() is not None and t["started_at"].min() is not None
                   else None),
        "test_loss": {r["arm"]: r["test_loss"] for r in done.group_by("arm").agg(
            pl.col("test_loss").drop_nans().mean()).sort("arm").to_dicts()},
    }
    seeds = grid_seeds(t.filter(pl.col("status") == "terminated") if finished_only else t)
    out["grid_seeds"] = seeds
    out["gap_per_seed"], out["last_layer"] = {}, {}
    try:
        units = pr_gap_units(store, scope, level="run", finished_only=finished_only)
    except AnalysisError:
        return out
    units = units.filter(pl.col("seed").is_in(seeds))
    final = summarise_gap(units, summary="final", level="run")
    for r in final.group_by("seed").agg((pl.col("value") > 0).sum().alias("pos"),
                                        pl.len().alias("n")).sort("seed").to_dicts():
        out["gap_per_seed"][r["seed"]] = [int(r["pos"]), int(r["n"])]
    last = (units.sort("step").group_by(["trial_id", "layer"]).last()
            .filter(pl.col("layer") == pl.col("depth") - 1))
    for r in last.group_by("depth").agg(
            pl.col("pr_q").mean(), pl.col("pr_k").mean(),
            (pl.col("pr_q") > pl.col("pr_k")).sum().alias("q_gt_k"),
            pl.len().alias("n")).sort("depth").to_dicts():
        out["last_layer"][r["depth"]] = {"pr_q": r["pr_q"], "pr_k": r["pr_k"],
                                         "q_gt_k": int(r["q_gt_k"]), "n": int(r["n"])}
    return out
