"""Charts of the study: each function takes a tidy DataFrame and returns an altair chart.

The caller decides where a chart goes (:func:`save_chart`). Data are aggregated here
before plotting so a chart's inline data stay small: trajectories are binned on training
progress (at most :data:`PROGRESS_BINS` + 1 points per line) and scatters are subsampled
deterministically to :data:`MAX_POINTS` points. Inputs may be polars or pandas frames.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import altair as alt
import polars as pl

from qkgeom.errors import QkgeomError

PROGRESS_BINS = 40  # progress is rounded to multiples of 1/40 before plotting
MAX_POINTS = 4000  # scatter points kept (altair inlines every row)
ARM_ORDER = ["none", "hold", "shrink", "shrink_act"]
ARM_COLORS = ["#4c4c4c", "#1f77b4", "#d62728", "#ff7f0e"]
METRIC_TITLES = {
    "pr_q": "PR_Q (query activations)",
    "pr_k": "PR_K (key activations)",
    "pr_wk": "PR of W_K (weights)",
    "pr_wq": "PR of W_Q (weights)",
    "entropy": "attention entropy (nats)",
    "entropy_norm": "normalised entropy",
    "qk_pr": "PR of W_Q W_K^T",
    "qk_erank": "eff. rank of W_Q W_K^T",
    "token_erank": "eff. rank of token interaction",
    "logit_erank": "eff. rank of masked logits (retired)",  # rows of older databases
    "wk_target_pr": "W_K target PR",
}


class PlotError(QkgeomError):
    """Nothing to plot: the input frame lacks rows or columns."""


def _frame(df: Any, required: set[str], what: str) -> pl.DataFrame:
    if not isinstance(df, pl.DataFrame):
        df = pl.from_pandas(df) if hasattr(df, "to_numpy") else pl.DataFrame(df)
    missing = required - set(df.columns)
    if missing:
        raise PlotError(f"{what} plot needs columns {sorted(missing)}; got {df.columns}")
    df = df.filter(pl.col("value").is_not_null() & pl.col("value").is_finite()) \
        if "value" in df.columns else df
    if df.height == 0:
        raise PlotError(f"no finite values to draw in the {what} plot; check the sweep has "
                        "probe metrics (qkgeom status --name SWEEP)")
    return df


def _bin_progress(df: pl.DataFrame) -> pl.DataFrame:
    return df.with_columns(
        (pl.col("progress").fill_null(0.0) * PROGRESS_BINS).round(0).truediv(PROGRESS_BINS)
        .alias("progress"))


def trajectories(df: Any, *, per_seed: bool = False) -> alt.FacetChart:
    """PR_Q (solid) and PR_K (dashed) over training progress, one colour per layer.

    ``df`` columns: depth, init, layer, metric (pr_q / pr_k), progress, value: one row
    per trajectory point (already averaged over seeds, e.g. from ``v_trajectories``), or,
    with ``per_seed``, also ``seed``: one pair of lines per seed.
    Rows are depths, columns are initialisations.
    """
    d = _frame(df, {"depth", "init", "layer", "metric", "progress", "value"}, "trajectories")
    d = d.filter(pl.col("metric").is_in(["pr_q", "pr_k"]))
    if d.height == 0:
        raise PlotError("no pr_q / pr_k rows to draw in the trajectories plot")
    per_seed = per_seed and "seed" in d.columns
    keys = ["depth", "init", "layer", "metric"] + (["seed"] if per_seed else [])
    d = (_bin_progress(d)
         .group_by([*keys, "progress"])
         .agg(pl.col("value").mean())
         .with_columns(pl.col("metric").replace({"pr_q": "PR_Q", "pr_k": "PR_K"}))
         .sort([*keys, "progress"]))
    base = alt.Chart(d).mark_line(strokeWidth=1.6).encode(
        x=alt.X("progress:Q", title="training progress (step / max_steps)",
                scale=alt.Scale(domain=[0, 1])),
        y=alt.Y("value:Q", title="participation ratio (dims)"),
        color=alt.Color("layer:O", title="layer", scale=alt.Scale(scheme="viridis")),
        strokeDash=alt.StrokeDash("metric:N", title="metric",
                                  sort=["PR_Q", "PR_K"],
                                  scale=alt.Scale(domain=["PR_Q", "PR_K"],
                                                  range=[[1, 0], [5, 3]])),
        detail=["metric:N", "seed:O"] if per_seed else "metric:N",
        tooltip=["depth:O", "init:N", "layer:O", "metric:N"] + (["seed:O"] if per_seed else [])
        + [alt.Tooltip("progress:Q", format=".3f"), alt.Tooltip("value:Q", format=".3f")],
    ).properties(width=220, height=160)
    how = "one pair of lines per seed" if per_seed else "mean over seeds"
    return base.facet(
        row=alt.Row("depth:O", title="depth (layers)"),
        column=alt.Column("init:N", title="Q/K initialisation"),
    ).properties(title=f"PR_Q (solid) and PR_K (dashed) per layer, {how}")


def metric_trajectories(df: Any, metric: str, *, per_trial: bool = False) -> alt.FacetChart:
    """One stored metric over training progress, one colour per layer; rows are depths,
    columns initialisations (any metric, e.g. for a live view of a running sweep).

    ``df`` columns: depth, init, layer, progress, value, and ``seed`` (one line per seed,
    ``per_trial``) or not (the mean over seeds). Only the baseline arm should be passed
    when the sweep has intervention arms (the caller filters).
    """
    d = _frame(df, {"depth", "init", "layer", "progress", "value"}, f"{metric} trajectories")
    keys = ["depth", "init", "layer"] + (["seed"] if per_trial and "seed" in d.columns else [])
    d = (_bin_progress(d).group_by([*keys, "progress"]).agg(pl.col("value").mean())
         .sort([*keys, "progress"]))
    title = METRIC_TITLES.get(metric, metric)
    tooltip: list[Any] = ["depth:O", "init:N", "layer:O"] + (
        ["seed:O"] if "seed" in keys else []) + [
        alt.Tooltip("progress:Q", format=".3f"), alt.Tooltip("value:Q", format=".4f")]
    base = alt.Chart(d).mark_line(strokeWidth=1.4, opacity=0.85 if "seed" in keys else 1.0
                                  ).encode(
        x=alt.X("progress:Q", title="training progress (step / max_steps)",
                scale=alt.Scale(domain=[0, 1])),
        y=alt.Y("value:Q", title=title, scale=alt.Scale(zero=False)),
        color=alt.Color("layer:O", title="layer", scale=alt.Scale(scheme="viridis")),
        detail="seed:O" if "seed" in keys else "layer:O",
        tooltip=tooltip,
    ).properties(width=220, height=160)
    how = "one line per seed" if "seed" in keys else "mean over seeds"
    return base.facet(
        row=alt.Row("depth:O", title="depth (layers)"),
        column=alt.Column("init:N", title="Q/K initialisation"),
    ).properties(title=f"{title} per layer, {how}")


def intervention(df: Any, *, metrics: tuple[str, ...] = ("entropy", "pr_wk", "pr_k")
                 ) -> alt.FacetChart:
    """Each arm over training, mean over seeds with a min-max band across seeds.

    ``df`` columns: arm, seed, progress, metric, value, where value is one trial's value at
    one probe, already averaged over layers (heads). Panels, left to right: attention
    entropy, the achieved W_K weight PR and the key-activation PR_K, so a reader sees
    whether ``shrink`` really contracted the keys relative to the baseline ``none``.
    """
    d = _frame(df, {"arm", "seed", "progress", "metric", "value"}, "intervention")
    d = d.filter(pl.col("metric").is_in(list(metrics)))
    if d.height == 0:
        raise PlotError(f"no {', '.join(metrics)} rows to draw in the intervention plot")
    per_seed = (_bin_progress(d).group_by(["metric", "arm", "seed", "progress"])
                .agg(pl.col("value").mean()))
    agg = (per_seed.group_by(["metric", "arm", "progress"])
           .agg(pl.col("value").mean().alias("mean"), pl.col("value").min().alias("lo"),
                pl.col("value").max().alias("hi"), pl.len().alias("n_seeds"))
           .with_columns(pl.col("metric").replace(METRIC_TITLES).alias("panel"))
           .sort(["metric", "arm", "progress"]))
    arms = [a for a in ARM_ORDER if a in set(agg["arm"])] + sorted(
        set(agg["arm"]) - set(ARM_ORDER))
    palette = (ARM_COLORS + ["#2ca02c", "#9467bd", "#8c564b", "#e377c2"])[: len(arms)]
    agg = agg.with_columns(pl.col("arm").replace_strict(dict(zip(arms, palette)),
                                                        default="#7f7f7f").alias("fill"))
    color = alt.Color("arm:N", title="arm", sort=arms,
                      scale=alt.Scale(domain=arms, range=palette))
    x = alt.X("progress:Q", title="training progress", scale=alt.Scale(domain=[0, 1]))
    band = alt.Chart().mark_area(opacity=0.18).encode(
        x=x, y=alt.Y("lo:Q", title=None, scale=alt.Scale(zero=False)), y2="hi:Q",
        # fill straight from a colour column (no scale), so the only legend is the lines'
        fill=alt.Fill("fill:N", scale=None))
    line = alt.Chart().mark_line(strokeWidth=2).encode(
        x=x, y=alt.Y("mean:Q", title=None), color=color,
        tooltip=["arm:N", "panel:N", alt.Tooltip("progress:Q", format=".3f"),
                 alt.Tooltip("mean:Q", format=".4f"), "n_seeds:Q"])
    order = [METRIC_TITLES.get(m, m) for m in metrics]
    return alt.layer(band, line, data=agg).properties(width=230, height=180).facet(
        column=alt.Column("panel:N", title=None, sort=order),
    ).resolve_scale(y="independent").properties(
        title="Intervention arms: mean over seeds, band = min-max across seeds")


def correlation(df: Any, *, x: str, y: str, rho: float | None = None,
                seed: int = 0) -> alt.Chart:
    """Scatter of metric ``x`` against metric ``y``, one point per (run, probe, layer).

    ``df`` columns: ``x``, ``y`` (named after the metrics), and optionally depth, arm.
    More than :data:`MAX_POINTS` rows are subsampled with ``seed`` (the title says so).
    """
    d = _frame(df, {x, y}, "correlation")
    d = d.filter(pl.col(x).is_finite() & pl.col(y).is_finite())
    if d.height == 0:
        raise PlotError(f"no finite ({x}, {y}) pairs to draw in the correlation plot")
    n = d.height
    if n > MAX_POINTS:
        d = d.sample(MAX_POINTS, seed=seed, shuffle=False)
    title = f"{METRIC_TITLES.get(y, y)} vs {METRIC_TITLES.get(x, x)}"
    sub = f"{n} points" if n <= MAX_POINTS else f"{MAX_POINTS} of {n} points (random subsample)"
    if rho is not None:
        sub += f"; Spearman rho = {rho:.3f}"
    enc: dict[str, Any] = dict(
        x=alt.X(f"{x}:Q", title=METRIC_TITLES.get(x, x), scale=alt.Scale(zero=False)),
        y=alt.Y(f"{y}:Q", title=METRIC_TITLES.get(y, y), scale=alt.Scale(zero=False)),
    )
    if "depth" in d.columns:
        enc["color"] = alt.Color("depth:O", title="depth", scale=alt.Scale(scheme="dark2"))
    if "arm" in d.columns and d["arm"].n_unique() > 1:
        enc["shape"] = alt.Shape("arm:N", title="arm")
    cols = [c for c in (x, y, "depth", "arm") if c in d.columns]
    return alt.Chart(d.select(cols)).mark_point(size=14, opacity=0.45, filled=True).encode(
        **enc).properties(width=420, height=320, title=alt.Title(title, subtitle=sub))


def checkpoint_trends(df: Any) -> alt.LayerChart:
    """PR_Q - PR_K (mean over layers) over each pretrained model's checkpoints (claim 5).

    ``df`` columns: model, step, value (one row per checkpoint), and optionally
    ``peak`` (True at the checkpoint where the model's value peaks): one line per model,
    points at the measured checkpoints, the peak as a larger ring.
    """
    d = _frame(df, {"model", "step", "value"}, "checkpoint trends").sort(["model", "step"])
    if d.height == 0:
        raise PlotError("no pretrained checkpoints with a step to draw")
    enc = dict(
        x=alt.X("step:Q", title="training step of the checkpoint"),
        y=alt.Y("value:Q", title="PR_Q - PR_K (mean over layers)", scale=alt.Scale(zero=False)),
        color=alt.Color("model:N", title="model"),
        tooltip=["model:N", "step:Q", alt.Tooltip("value:Q", format=".4f")],
    )
    base = alt.Chart(d)
    layers = [base.mark_line(strokeWidth=1.6, point=True).encode(**enc)]
    if "peak" in d.columns:
        layers.append(base.transform_filter(alt.datum.peak).mark_point(
            size=160, strokeWidth=2, filled=False).encode(**enc))
    return alt.layer(*layers).properties(
        width=520, height=220,
        title="PR_Q - PR_K over pretraining checkpoints (ring: the peak)")


def save_chart(chart: alt.TopLevelMixin, path: str | Path, *, scale: float = 2.0) -> Path:
    """Write ``chart`` to ``path``; the suffix picks the format (.html, .png, .svg, .json).

    HTML is self-contained: the vega scripts are inlined, so it opens offline.
    """
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in (".html", ".png", ".svg", ".json"):
        raise PlotError(f"cannot write {p.name}: use a .html, .png, .svg or .json file name")
    if not p.parent.is_dir():
        raise PlotError(f"directory {p.parent} does not exist; create it first")
    if p.is_dir():
        raise PlotError(f"{p} is a directory; give a file name with --out")
    try:
        if suffix == ".html":
            chart.save(str(p), format="html", inline=True)
        elif suffix == ".png":
            chart.save(str(p), format="png", scale_factor=scale)
        else:
            chart.save(str(p), format=suffix[1:])
    except OSError as e:
        raise PlotError(f"cannot write {p}: {e.strerror or e}; give a writable --out") \
            from None
    return p


def to_svg(chart: alt.TopLevelMixin) -> str:
    """The chart rendered as an SVG document (text), for inline embedding."""
    import vl_convert as vlc

    return vlc.vegalite_to_svg(chart.to_dict(), vl_version=_vl_version())


def to_png(chart: alt.TopLevelMixin, *, scale: float = 2.0) -> bytes:
    import vl_convert as vlc

    return vlc.vegalite_to_png(chart.to_dict(), vl_version=_vl_version(), scale=scale)


def _vl_version() -> str:
    # e.g. "6.1.0" -> "6.1", the form vl_convert expects
    return ".".join(alt.SCHEMA_VERSION.lstrip("v").split(".")[:2])


def final_gap(df: Any, *, facet: str = "cell") -> alt.FacetChart:
    """PR_Q - PR_K at the last probe per (depth, layer), one panel per value of ``facet``
    (a cell label or a factor such as ``n_embd``), one colour per initialisation: where
    the gap turns negative as the factor moves (claim 2, seen across cells).

    ``df`` columns: ``facet``, depth, init, layer, value (the gap of one run or already a
    mean; averaged over seeds here). Rows are depths.
    """
    d = _frame(df, {facet, "depth", "init", "layer", "value"}, "final-gap")
    d = (d.group_by([facet, "depth", "init", "layer"]).agg(pl.col("value").mean(),
                                                          pl.len().alias("n_runs"))
         .sort([facet, "depth", "init", "layer"]))
    points = alt.Chart().mark_line(point=True, strokeWidth=1.4).encode(
        x=alt.X("layer:O", title="layer"),
        y=alt.Y("value:Q", title="PR_Q - PR_K at the last probe (dims)"),
        color=alt.Color("init:N", title="Q/K initialisation"),
        tooltip=[f"{facet}:N", "depth:O", "init:N", "layer:O", "n_runs:Q",
                 alt.Tooltip("value:Q", format=".3f")],
    )
    zero = alt.Chart().mark_rule(color="#888", strokeDash=[3, 3]).encode(y=alt.datum(0))
    return alt.layer(points, zero, data=d).properties(width=160, height=130).facet(
        row=alt.Row("depth:O", title="depth (layers)"),
        column=alt.Column(f"{facet}:N", title=facet),
    ).properties(title=f"PR_Q - PR_K at the last probe per layer, by {facet} "
                       "(mean over seeds; below the dashed line keys end above queries)")
