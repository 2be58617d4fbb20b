"""Claim 4: the intervention arms against their paired baselines (per seed), with
bootstrap directional confidence and the achieved key geometry."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl

from qkgeom import stats
from qkgeom.analysis.common import (
    BASELINE_ARM,
    DEFAULT_LAST_PROBES,
    PREDICTED_SIGN,
    AnalysisError,
    make_rng,
)
from qkgeom.analysis.scope import scope_fields, sweep_name
from qkgeom.analysis.trials import check_metric, require_one_cell, select_trials, sweep_trials
from qkgeom.store.queries import layer_values

if TYPE_CHECKING:
    from qkgeom.store import Store


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


def mean_of_last_probes(values: pl.DataFrame, window: int, by_layer: bool) -> pl.DataFrame:
    """Mean per trial (and layer) over the trial's last ``window`` probe steps (a count of
    probes, not a trend window)."""
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


@dataclass
class PairedTrials:
    """The trials one paired comparison uses: ``arm`` trials, the ``baseline`` trials in
    the arm's (depth, init) cells, and every trial of either arm (``both``)."""

    arm: pl.DataFrame
    baseline: pl.DataFrame
    both: pl.DataFrame
    cells: pl.DataFrame  # depth, init of the arm's trials


def paired_trials(store: Store, sweep: str, *, arm: str, baseline: str,
                  finished_only: bool) -> PairedTrials:
    """The trials of ``arm`` and its baseline, or an error saying why there are none."""
    t_all = sweep_trials(store, sweep)
    arms_present = sorted(set(t_all["arm"].to_list()))
    if not [a for a in arms_present if a != baseline]:
        raise AnalysisError(
            f"sweep {sweep!r} has no intervention arms (only arm {baseline!r}, "
            f"{t_all.height} trials); run an intervention sweep with arms hold/shrink")
    if arm not in arms_present:
        raise AnalysisError(f"sweep {sweep!r} has no trials of arm {arm!r}; arms present: "
                            f"{', '.join(arms_present)}")
    if arm == baseline:
        raise AnalysisError(f"--arm and --baseline are both {arm!r}; compare two arms")
    t = select_trials(store, sweep, arms=[arm, baseline], finished_only=finished_only)
    t_arm = t.filter(pl.col("arm") == arm)
    if t_arm.height == 0:
        raise AnalysisError(f"no finished trials of arm {arm!r} in sweep {sweep!r}; wait for "
                            "them or pass --include-unfinished")
    if baseline == BASELINE_ARM:  # an arm trained against another baseline run: refuse
        from qkgeom.plan.pairing import inconsistent_pairs

        bad = inconsistent_pairs(store, sweep_name(sweep), t_arm["trial_id"].to_list())
        if bad:
            raise AnalysisError(
                f"{len(bad)} {arm!r} trial(s) cannot be paired: {bad[0]}"
                + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
                + f"; rerun them with: qkgeom sweep --resume --name {sweep}")
    cells = t_arm.select("depth", "init").unique()
    t_base = t.filter(pl.col("arm") == baseline).join(cells, on=["depth", "init"])
    return PairedTrials(t_arm, t_base, t, cells)


def pair_by_seed(values: pl.DataFrame, pt: PairedTrials, *, window: int,
                 by_layer: bool) -> pl.DataFrame:
    """Arm and baseline side by side per (depth, init, seed[, layer]): arm_value,
    arm_trials, arm_last_step, the same for the baseline, and delta = arm - baseline."""
    end = mean_of_last_probes(values, window, by_layer)
    keys = ["depth", "init", "seed"] + (["layer"] if by_layer else [])

    def side(tt: pl.DataFrame, name: str) -> pl.DataFrame:
        return end.join(tt.select("trial_id", "depth", "init", "seed"), on="trial_id") \
            .group_by(keys).agg(pl.col("value").mean().alias(f"{name}_value"),
                                pl.col("trial_id").n_unique().alias(f"{name}_trials"),
                                pl.col("last_step").max().alias(f"{name}_last_step"))

    return side(pt.arm, "arm").join(side(pt.baseline, "baseline"), on=keys, how="inner") \
        .with_columns((pl.col("arm_value") - pl.col("baseline_value")).alias("delta")) \
        .sort(keys)


def _seeds(t: pl.DataFrame) -> list[int]:
    return sorted(set(t["seed"].to_list()))


def require_pairs(table: pl.DataFrame, pt: PairedTrials, *, arm: str, baseline: str,
                  metric: str) -> None:
    """At least two seeds with a finite delta, else an error naming the seeds to run."""
    n_ok = table.filter(pl.col("delta").is_finite()).height
    if n_ok >= 2:
        return
    a_seeds, b_seeds = _seeds(pt.arm), _seeds(pt.baseline)
    cells_s = ", ".join(f"depth {d} init {i}" for d, i in pt.cells.sort(["depth", "init"])
                        .iter_rows())
    raise AnalysisError(
        f"too few seeds to pair arm {arm!r} with baseline {baseline!r} at {cells_s}: "
        f"arm {arm!r} has {len(a_seeds)} seeds {a_seeds}, baseline {baseline!r} has "
        f"{len(b_seeds)} seeds {b_seeds}; {n_ok} paired with a finite {metric}, "
        "need at least 2 (run the missing seeds)")


def pairing_notes(table: pl.DataFrame, pt: PairedTrials, *, baseline: str) -> list[str]:
    """What the reader of a paired comparison should know: unpaired seeds, averaged
    baselines, pairs that end at different steps."""
    notes: list[str] = []
    unpaired = sorted(set(_seeds(pt.arm)) ^ set(_seeds(pt.baseline)))
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
    return notes


def paired_deltas(store: Store, sweep: str, *, arm: str, baseline: str = BASELINE_ARM,
                  metric: str = "entropy", window: int = DEFAULT_LAST_PROBES,
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
    pt = paired_trials(store, sweep, arm=arm, baseline=baseline, finished_only=finished_only)
    ids = pt.both["trial_id"].to_list()
    if values is None:
        vals = layer_values(store, ids, [metric])
    else:
        vals = values.filter((pl.col("metric") == metric) & pl.col("trial_id").is_in(ids))
    if vals.height == 0:
        raise AnalysisError(f"sweep {sweep!r} has no layer-level {metric!r} values for arms "
                            f"{arm!r}/{baseline!r}; were the trials probed?")
    table = pair_by_seed(vals, pt, window=window, by_layer=False)
    require_pairs(table, pt, arm=arm, baseline=baseline, metric=metric)
    per_layer_table = pair_by_seed(vals, pt, window=window, by_layer=True) if per_layer \
        else None
    return PairedDeltas(sweep, arm, baseline, metric, window, table, per_layer_table,
                        pairing_notes(table, pt, baseline=baseline))


def intervention_values(store: Store, sweep: str, *, arm: str, baseline: str,
                        metrics: list[str]) -> pl.DataFrame | None:
    """Layer rows of ``metrics`` for the arm's trials and the baseline trials in the arm's
    (depth, init) cells, read in one query (None when the arm has no trials)."""
    t = sweep_trials(store, sweep, "cell")
    require_one_cell(t, sweep)
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
        raise AnalysisError(f"no default prediction for arm {arm!r} (shrink, shrink_act "
                            "predict -1; hold +1); pass --predicted-sign -1 or 1")
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
        d: dict[str, Any] = {**scope_fields(p.sweep), "arm": p.arm, "baseline": p.baseline,
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


def key_check(store: Store, sweep: str, *, arm: str, baseline: str = BASELINE_ARM,
              window: int = DEFAULT_LAST_PROBES, finished_only: bool = True,
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
                  "n_higher": int((d > 0).sum()), "deltas": d.tolist(),
                  "relative_delta": float(d.mean() / np.nanmean(
                      p.table["baseline_value"].to_numpy()))}
    return out


def directional(store: Store, sweep: str, *, arm: str, baseline: str = BASELINE_ARM,
                metric: str = "entropy", window: int = DEFAULT_LAST_PROBES,
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
                                       n_boot=n_boot, rng=make_rng(seed))
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
                                             rng=make_rng(seed, int(layer) + 1))
            layers.append({"layer": layer, **{k: v for k, v in r.to_dict().items()
                                              if k not in ("deltas",)}})
        layers.sort(key=lambda x: x["layer"])
    kc = key_check(store, sweep, arm=arm, baseline=baseline, window=window,
                   finished_only=finished_only, values=values) if with_key_check else None
    return DirectionalReport(p, res, seed, layers, kc)


def intervention_frame(store: Store, sweep: str, *,
                       metrics: tuple[str, ...] = ("entropy", "pr_wk", "pr_k"),
                       baseline: str = BASELINE_ARM, finished_only: bool = True
                       ) -> pl.DataFrame:
    """Per trial and probe, each metric averaged over layers, for the intervention cells:
    depth, init, arm, seed, trial_id, step, progress, metric, value."""
    t_all = sweep_trials(store, sweep)
    arms = sorted(set(t_all["arm"].to_list()) - {baseline})
    if not arms:
        raise AnalysisError(
            f"sweep {sweep!r} has no intervention arms (only arm {baseline!r}, "
            f"{t_all.height} trials); run an intervention sweep with arms hold/shrink")
    t = select_trials(store, sweep, finished_only=finished_only)
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
