"""Claim 5: the trend of PR_Q - PR_K over a pretrained model's checkpoints."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import polars as pl

from qkgeom import stats
from qkgeom.analysis.common import AnalysisError, make_rng, wide
from qkgeom.store.queries import pretrained_layer_values, pretrained_models

if TYPE_CHECKING:
    from qkgeom.store import Store


@dataclass
class CheckpointTrendReport:
    model: str
    overall: stats.TrendResult  # PR_Q - PR_K averaged over layers, vs step
    by_layer: list[dict[str, Any]]
    link: dict[str, Any] | None  # Spearman of interaction rank vs entropy
    n_layers: int
    split: stats.SplitTrend | None = None  # the verdict's pre-specified halves
    stratified_link: stats.StratifiedLink | None = None  # the verdict's link (per checkpoint)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "statistic": "PR_Q - PR_K (layer-level, mean over "
                "layers for overall)", **self.overall.to_dict(), "n_layers": self.n_layers,
                "n_layers_rise_then_decay": sum(r["rises_then_decays"] for r in self.by_layer),
                "by_layer": self.by_layer, "rank_entropy_link": self.link,
                "split_trend": self.split.to_dict() if self.split else None,
                "stratified_link": (self.stratified_link.to_dict()
                                    if self.stratified_link else None)}


def checkpoint_trend(store: Store, model: str, *, link_x: str = "qk_erank",
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
    df = pretrained_layer_values(store, model, ["pr_q", "pr_k", link_x, link_y])
    w = wide(df.filter(pl.col("metric").is_in(["pr_q", "pr_k"])), ["pr_q", "pr_k"],
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
    from qkgeom.stats import rules

    split = rules.split_trend(per_step["step"].to_numpy(), per_step["gap"].to_numpy(),
                              rng=make_rng(0, 5))
    link, slink = None, None
    lw = wide(df.filter(pl.col("metric").is_in([link_x, link_y])), [link_x, link_y],
               ["revision", "layer"])
    if lw.height >= 3:
        r = stats.spearman_ci(lw[link_x].to_numpy(), lw[link_y].to_numpy(), n_boot=1000,
                              rng=make_rng(0))
        link = {"x": link_x, "y": link_y, **r.to_dict()}
        slink = rules.stratified_link(lw[link_x].to_numpy(), lw[link_y].to_numpy(),
                                      lw["revision"].to_numpy(), lw["layer"].to_numpy(),
                                      rng=make_rng(0, 6))
    return CheckpointTrendReport(model, overall, by_layer, link, int(w["layer"].n_unique()),
                                 split, slink)
