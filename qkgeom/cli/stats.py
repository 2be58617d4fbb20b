"""``qkgeom stats ...``, ``qkgeom plot ...`` and ``qkgeom report``: the study's verdicts.

Thin: parse options, open the database read-only, call :mod:`qkgeom.analysis` /
:mod:`qkgeom.report.plots` / :mod:`qkgeom.report.render`, print. ``--format json`` prints exactly one
JSON object (NaN and infinities as null); the same ``--seed`` gives byte-identical output.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import click

from qkgeom.cli import main
from qkgeom.cli.common import db_option, format_option, user_errors

if TYPE_CHECKING:
    from qkgeom.store import Store

SWEEP_HELP = "sweep name (optional when the database holds exactly one sweep)"

# --format table|json, passed to the commands as ``fmt``
table_or_json = format_option("table", "json", dest="fmt")


WHERE_HELP = ("only trials whose factor takes this value (repeatable; values joined by "
              "commas are alternatives): a config key (n_embd=48, lr=0.001,0.003), cell, "
              "depth, init, arm, seed or status; config.KEY always means the config key "
              "and trial.COLUMN the trial column")


@dataclass(frozen=True)
class SweepChoice:
    """What --sweep, --where and --seeds asked for, resolved against the database by
    :meth:`resolve` (to a :class:`qkgeom.analysis.Scope`)."""

    name: str | None
    where: tuple[str, ...] = ()
    seeds: str | None = None

    def resolve(self, store: Store) -> Any:
        from qkgeom import analysis as A

        return A.resolve_scope(store, self.name, self.where, self.seeds)


def sweep_options(f: Callable) -> Callable:
    """--db, --sweep, --where, --seeds and --include-unfinished; the command receives
    ``sweep`` as a :class:`SweepChoice`."""

    @functools.wraps(f)
    def wrapper(*args: Any, sweep: str | None, where: tuple[str, ...], seeds: str | None,
                **kwargs: Any) -> Any:
        return f(*args, sweep=SweepChoice(sweep, tuple(where), seeds), **kwargs)

    w: Callable = wrapper
    w = click.option("--include-unfinished", is_flag=True,
                     help="also use trials that have not terminated (partial runs)")(w)
    w = click.option("--seeds", default=None, metavar="S[,S...]",
                     help="only trials of these seeds (e.g. 0,1)")(w)
    w = click.option("--where", multiple=True, metavar="FACTOR=VALUE", help=WHERE_HELP)(w)
    w = click.option("--sweep", default=None, metavar="NAME", help=SWEEP_HELP)(w)
    return db_option(w)


def window_option(f: Callable) -> Callable:
    return click.option(
        "--from", "window", default="start", show_default=True,
        metavar="start|late|collapse|P",
        help="trend window: every probe (start); from training progress 0.25, the "
             "report's pre-specified window (late); from each unit's own minimum of PR_Q + "
             "PR_K in the first half of training (collapse: descriptive, it biases later "
             "slopes upward); or from training progress P in [0, 1)")(f)


def _store(db: str | None) -> Store:
    """The database, opened read-only (use in a ``with`` block)."""
    from qkgeom.store import open_store

    return open_store(db, create=False, readonly=True)


def print_json(obj: dict[str, Any]) -> None:
    from qkgeom.records import to_jsonable

    click.echo(json.dumps(to_jsonable(obj), indent=2, allow_nan=False))


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None,
          headers: Sequence[str] | None = None) -> str:
    """A plain aligned text table (numbers right-aligned)."""
    from qkgeom.analysis import fmt

    if not rows:
        return "(no rows)"
    cols = list(columns or rows[0].keys())
    heads = list(headers or cols)
    cells = [[fmt(r.get(c)) for c in cols] for r in rows]
    num = [all(isinstance(r.get(c), (int, float)) and not isinstance(r.get(c), bool)
               for r in rows) for c in cols]
    widths = [max(len(h), *(len(row[i]) for row in cells)) for i, h in enumerate(heads)]

    def line(vals: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if n else v.ljust(w)
                         for v, w, n in zip(vals, widths, num)).rstrip()

    out = [line(heads), line(["-" * w for w in widths])]
    out += [line(r) for r in cells]
    return "\n".join(out)


def _body(f: Callable) -> Callable:
    """Run the command body under user_errors (library errors -> one-line messages)."""

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with user_errors():
            return f(*args, **kwargs)

    return wrapper


# --------------------------------------------------------------------------- stats


@main.group("stats")
def stats_group() -> None:
    """The study's statistics, read from the results database (see docs/statistics.md)."""


@stats_group.command("sign-test")
@sweep_options
@click.option("--summary", type=click.Choice(["final", "mean", "all"]), default="final",
              show_default=True,
              help="per-unit summary of PR_Q - PR_K: the final probe, the mean over probes "
                   "after step 0, or 'all' (positive only if every probe after step 0 is)")
@click.option("--level", type=click.Choice(["trajectory", "run"]), default="trajectory",
              show_default=True,
              help="unit: a (depth, init, layer) curve averaged over seeds, or one run's layer")
@click.option("--depth", type=int, default=None, help="only this depth")
@click.option("--init", default=None, help="only this Q/K initialisation")
@window_option
@table_or_json
@_body
def sign_test_cmd(db: str | None, sweep: SweepChoice, include_unfinished: bool, summary: str,
                  level: str, depth: int | None, init: str | None, window: str,
                  fmt: str) -> None:
    """One-sided exact sign test that PR_Q - PR_K > 0 (geometry trials, arm none).

    --from restricts the probes that the mean and all summaries use; the final probe is
    the same in every window.
    """
    from qkgeom import analysis as A

    win = A.parse_window(window)
    with _store(db) as store:
        name = sweep.resolve(store)
        rep = A.sign_test(store, name, summary=summary, level=level, depth=depth, init=init,
                          finished_only=not include_unfinished, window=win)
    d = rep.to_dict()
    if fmt == "json":
        print_json(d)
        return
    r = rep.result
    click.echo(f"Sign test of PR_Q - PR_K > 0: sweep {name}, unit {level}, summary {summary}, "
               f"{A.window_label(win)}")
    if rep.collapse:
        click.echo(_collapse_line(rep.collapse))
    click.echo(table(d["by_depth_init"], ["depth", "init", "n", "n_positive", "n_zero",
                                          "p_value"]))
    click.echo(f"\noverall: {r.n_positive} of {r.n} positive ({r.n_zero} zero, "
               f"{r.n_dropped} non-finite left out); one-sided exact binomial "
               f"p = {A.fmt(r.p_value)}")
    neg = rep.units.filter(rep.units["value"] <= 0)
    if neg.height:
        click.echo(f"units with PR_Q - PR_K <= 0 ({neg.height}):")
        click.echo(table(neg.head(20).to_dicts()))


@stats_group.command("slopes")
@sweep_options
@click.option("--level", type=click.Choice(["trajectory", "run"]), default="trajectory",
              show_default=True, help="unit: trajectory (mean over seeds) or one run's layer")
@click.option("--depth", type=int, default=None, help="only this depth")
@click.option("--init", default=None, help="only this Q/K initialisation")
@window_option
@table_or_json
@_body
def slopes_cmd(db: str | None, sweep: SweepChoice, include_unfinished: bool, level: str,
               depth: int | None, init: str | None, window: str, fmt: str) -> None:
    """Least-squares slopes of PR_Q and PR_K against training progress, per unit, over the
    probes of the --from window."""
    from qkgeom import analysis as A

    win = A.parse_window(window)
    with _store(db) as store:
        name = sweep.resolve(store)
        rep = A.slopes(store, name, level=level, depth=depth, init=init,
                       finished_only=not include_unfinished, window=win)
    d = rep.to_dict(with_table=True)
    if fmt == "json":
        print_json(d)
        return
    click.echo(f"Slopes against training progress (value per unit of step/max_steps): "
               f"sweep {name}, unit {level}, {A.window_label(win)}")
    if rep.collapse:
        click.echo(_collapse_line(rep.collapse))
    rows = [{"metric": m.upper().replace("GAP", "PR_Q - PR_K"), **{k: d[m][k] for k in (
        "n", "mean", "median", "sd", "share_positive")}} for m in ("pr_q", "pr_k", "gap")]
    click.echo(table(rows))
    click.echo("\nby depth and init (mean slope):")
    click.echo(table(d["by_depth_init"]))


def _collapse_line(c: dict[str, Any]) -> str:
    from qkgeom.analysis import fmt

    if not c.get("n"):
        return "collapse points: none found"
    return (f"collapse points of {c['n']} units: step {c['step_min']} to {c['step_max']} "
            f"(median {fmt(c['step_median'], 1)}, progress {fmt(c['progress_median'], 3)})")


@stats_group.command("directional-confidence")
@sweep_options
@click.option("--arm", required=True, help="intervention arm, e.g. shrink or hold")
@click.option("--baseline", default="none", show_default=True, help="baseline arm")
@click.option("--metric", default="entropy", show_default=True, help="metric to compare")
@click.option("--window", type=click.IntRange(min=1), default=3, show_default=True,
              help="average over each trial's last N probes")
@click.option("--boot", type=int, default=10_000, show_default=True,
              help="bootstrap resamples (at least 10000)")
@click.option("--seed", type=int, default=0, show_default=True, help="bootstrap rng seed")
@click.option("--predicted-sign", type=click.Choice(["-1", "1"]), default=None,
              help="predicted sign of arm - baseline (default: shrink, shrink_act -1; hold +1)")
@click.option("--per-layer", is_flag=True, help="also break the effect down by layer")
@table_or_json
@_body
def directional_cmd(db: str | None, sweep: SweepChoice, include_unfinished: bool, arm: str,
                    baseline: str, metric: str, window: int, boot: int, seed: int,
                    predicted_sign: str | None, per_layer: bool, fmt: str) -> None:
    """Paired effect of an intervention arm vs the baseline, with bootstrap confidence.

    Per seed: Delta = metric(arm) - metric(baseline), each the mean over the last --window
    probes and over layers. Reports the mean Delta, a 95% BCa (and percentile) bootstrap
    CI, the share of bootstrap means with the predicted sign, and the exact paired sign
    test; plus the achieved key geometry (W_K weight PR, activation PR_K) vs baseline.
    """
    from qkgeom import analysis as A

    with _store(db) as store:
        name = sweep.resolve(store)
        rep = A.directional(store, name, arm=arm, baseline=baseline, metric=metric,
                            window=window, n_boot=boot, seed=seed,
                            predicted_sign=None if predicted_sign is None else int(predicted_sign),
                            per_layer=per_layer, finished_only=not include_unfinished)
    d = rep.to_dict()
    if fmt == "json":
        print_json(d)
        return
    r = rep.result
    sign = "lower" if r.predicted_sign < 0 else "higher"
    click.echo(f"{metric}: arm {arm} vs baseline {baseline} (sweep {name}; mean over the last "
               f"{window} probes and layers; predicted: {sign})")
    click.echo(table(d["pairs"]))
    click.echo(f"\nseeds paired: {r.n_seeds}   mean delta: {A.fmt(r.mean_delta)}   "
               f"sd: {A.fmt(r.sd_delta)}")
    click.echo(f"95% CI (BCa): [{A.fmt(r.ci_low)}, {A.fmt(r.ci_high)}]   percentile: "
               f"[{A.fmt(r.pct_low)}, {A.fmt(r.pct_high)}]   (B = {r.n_boot}, seed {seed})")
    click.echo(f"directional confidence: {A.fmt(r.directional_confidence)} of bootstrap means "
               f"are {sign}")
    click.echo(f"paired sign test: {r.n_agree} of {r.n_seeds} seeds {sign}, one-sided exact "
               f"p = {A.fmt(r.sign_test_p)}")
    if rep.per_layer:
        click.echo("\nper layer:")
        click.echo(table(rep.per_layer, ["layer", "n_seeds", "mean_delta", "ci_low", "ci_high",
                                         "directional_confidence", "sign_test_p"]))
    if rep.key_check:
        click.echo(f"\nachieved key geometry, arm {arm} vs {baseline} (end of training):")
        rows = []
        for m, v in rep.key_check.items():
            if "error" in v:
                rows.append({"metric": m, "note": v["error"]})
            else:
                rows.append({"metric": m, **{k: v[k] for k in (
                    "n_seeds", "arm_mean", "baseline_mean", "mean_delta", "relative_delta",
                    "n_lower", "n_higher")}})
        click.echo(table(rows))
    for note in rep.deltas.notes:
        click.echo(f"note: {note}")


@stats_group.command("correlate")
@sweep_options
@click.option("--x", "x", required=True, help="metric on the x axis, e.g. pr_k or qk_erank")
@click.option("--y", "y", required=True, help="metric on the y axis, e.g. entropy")
@click.option("--arm", default=None, help="only trials of this arm (default: all)")
@click.option("--boot", type=int, default=1000, show_default=True,
              help="bootstrap resamples for the CI")
@click.option("--seed", type=int, default=0, show_default=True, help="bootstrap rng seed")
@table_or_json
@_body
def correlate_cmd(db: str | None, sweep: SweepChoice, include_unfinished: bool, x: str, y: str,
                  arm: str | None, boot: int, seed: int, fmt: str) -> None:
    """Spearman correlation of two metrics across probes and runs, overall and per depth.

    One point per (trial, probe, layer), layer-level values. The CI is a cluster
    bootstrap over trials: each resample draws whole trials with replacement (probes of
    one run are not independent, so they are never split). Needs at least 3 trials.
    """
    from qkgeom import analysis as A

    with _store(db) as store:
        name = sweep.resolve(store)
        rep = A.correlate(store, name, x=x, y=y, n_boot=boot, seed=seed, arm=arm,
                          finished_only=not include_unfinished)
    d = rep.to_dict()
    if fmt == "json":
        print_json(d)
        return
    click.echo(f"Spearman of {y} vs {x}: sweep {name}, one point per (trial, probe, layer)"
               f"{'' if arm is None else f', arm {arm}'}")
    parts = [("all", d)] + [(str(r["depth"]), r) for r in d["by_depth"]]
    click.echo(table([{"depth": depth, "trials": r["n_clusters"],
                       **{k: r[k] for k in ("n", "rho", "ci_low", "ci_high")}}
                      for depth, r in parts]))
    click.echo(f"(95% percentile CI of a cluster bootstrap over trials: whole trials drawn "
               f"with replacement, B = {boot}, seed {seed}; nan below 3 trials)")


@stats_group.command("checkpoint-trend")
@db_option
@click.option("--model", required=True, help="pretrained model id as stored, e.g. "
              "EleutherAI/pythia-160m")
@table_or_json
@_body
def checkpoint_trend_cmd(db: str | None, model: str, fmt: str) -> None:
    """Trend of PR_Q - PR_K over a pretrained model's checkpoints, per layer.

    Spearman against step; the peak; and "rises then decays" = Spearman up to the peak > 0
    and from the peak on < 0 (each over at least 3 checkpoints).
    """
    from qkgeom import analysis as A

    with _store(db) as store:
        rep = A.checkpoint_trend(store, model)
    d = rep.to_dict()
    if fmt == "json":
        print_json(d)
        return
    o = rep.overall
    click.echo(f"PR_Q - PR_K over the checkpoints of {model} ({o.n_checkpoints} checkpoints, "
               f"{rep.n_layers} layers)")
    click.echo(table(d["by_layer"], ["layer", "n_checkpoints", "rho", "peak_step", "rho_early",
                                     "rho_late", "rises_then_decays"]))
    click.echo(f"\nmean over layers: rho = {A.fmt(o.rho)}, peak at step {o.peak_step}, "
               f"rho early = {A.fmt(o.rho_early)}, rho late = {A.fmt(o.rho_late)}, rises then "
               f"decays: {A.fmt(o.rises_then_decays)}")
    if rep.link:
        lk = rep.link
        click.echo(f"{lk['y']} vs {lk['x']} across checkpoints and layers: Spearman "
                   f"{A.fmt(lk['rho'])} [{A.fmt(lk['ci_low'])}, {A.fmt(lk['ci_high'])}] "
                   f"(n = {lk['n']})")


# --------------------------------------------------------------------------- plot, report


@main.command("plot")
@click.argument("kind", type=click.Choice(["trajectories", "intervention", "correlation",
                                           "final-gap"]))
@sweep_options
@click.option("--out", required=True, type=click.Path(dir_okay=False),
              help="output file: .html (self-contained), .png, .svg or .json (vega-lite)")
@click.option("--x", "x", default="pr_k", show_default=True, help="correlation: x metric")
@click.option("--y", "y", default="entropy", show_default=True, help="correlation: y metric")
@click.option("--facet", default=None, metavar="FACTOR",
              help="final-gap: one panel per value of this factor or 'cell' (default: the "
              "sweep's first factor)")
@table_or_json
@_body
def plot_cmd(kind: str, db: str | None, sweep: SweepChoice, include_unfinished: bool, out: str,
             x: str, y: str, facet: str | None, fmt: str) -> None:
    """Draw the trajectories, the intervention arms, a correlation scatter, or claim 2's
    final gap per layer across the cells of a sweep (final-gap, by --facet)."""
    import polars as pl

    from qkgeom import analysis as A
    from qkgeom.report import plots

    fin = not include_unfinished
    with _store(db) as store:
        name = sweep.resolve(store)
        if kind == "trajectories":
            chart = plots.trajectories(A.trajectory_frame(store, name, finished_only=fin))
        elif kind == "final-gap":
            from qkgeom.report.study import Study

            st = Study(store, name.name)
            ids = A.sweep_trials(store, name)["trial_id"].to_list()
            gap = st.gap_frame(finished_only=fin).filter(pl.col("trial_id").is_in(ids))
            chart = plots.final_gap(gap, facet=st.check_facet(facet))
        elif kind == "intervention":
            chart = plots.intervention(A.intervention_frame(store, name, finished_only=fin))
        else:
            pts = A.correlation_points(store, name, x=x, y=y, finished_only=fin)
            from qkgeom.stats import spearman

            chart = plots.correlation(pts, x=x, y=y, rho=spearman(pts[x].to_numpy(),
                                                                   pts[y].to_numpy()))
    path = plots.save_chart(chart, out)
    if fmt == "json":
        print_json({**A.scope_fields(name), "kind": kind, "out": str(path)})
    else:
        click.echo(f"wrote {path}")


@main.command("report")
@sweep_options
@click.option("--out", required=True, type=click.Path(file_okay=False),
              help="output directory (created): report.html, report.md, figures")
@click.option("--compare", "compare", multiple=True, metavar="SWEEP[@DB]",
              help="also decide this sweep (of --db, or of database DB) as cells of one "
              "comparison beside --sweep, with the sensitivity table; repeatable. --where "
              "and --seeds apply to every sweep")
@click.option("--ladder", "ladder", multiple=True, metavar="SWEEP[@DB]",
              help="a sweep whose cells (e.g. studies/ladder.yaml's) give the column 'on "
              "the ladder' of a one-cell report, decided here beside the report's own sweep; "
              "repeatable")
@click.option("--seed", type=int, default=0, show_default=True, help="bootstrap rng seed")
@click.option("--boot", type=int, default=10_000, show_default=True,
              help="bootstrap resamples for directional confidence")
@table_or_json
@_body
def report_cmd(db: str | None, sweep: SweepChoice, include_unfinished: bool, out: str,
               compare: tuple[str, ...], ladder: tuple[str, ...], seed: int, boot: int,
               fmt: str) -> None:
    """Write the study report: every claim of the paper beside its measured verdict.

    One self-contained HTML page (charts inline as SVG, works offline) and a markdown twin
    (report.md with PNG figures beside it). A sweep with cells, or --compare, decides every
    claim per cell and adds the sensitivity table (claim x factor).

    \b
    Examples:
      qkgeom report --sweep cpu --out reports/cpu --ladder ladder
      qkgeom report --sweep ladder-e96 --compare ladder-e128@e128.db --out reports/wide
    """
    from qkgeom import analysis as A
    from qkgeom.report.render import build_report
    from qkgeom.store import resolve_url
    from qkgeom.store.merge import gathered

    refs = [_ref(r, "--compare") for r in compare]
    lads = [_ref(r, "--ladder") for r in ladder]
    with _store(db) as first:
        main_name = A.resolve_sweep(first, sweep.name)
    with gathered(resolve_url(db), [(main_name, None), *refs, *lads]) as (store, names):
        scopes = [A.resolve_scope(store, n, sweep.where, sweep.seeds)
                  for n in names[:1 + len(refs)]]
        paths = build_report(store, scopes[0], out, compare=scopes[1:],
                             ladder=names[1 + len(refs):], seed=seed, n_boot=boot,
                             finished_only=not include_unfinished)
        name = scopes[0]
    data = json.loads(next(p for p in paths if p.name == "report.json").read_text())
    cells = data.get("cells") or [{"label": None, "claims": data["claims"]}]
    by_cell = {c["label"]: {k["key"]: k["verdict"] for k in c["claims"]} for c in cells}
    if fmt == "json":
        print_json({**A.scope_fields(name), "out": out, "files": [str(p) for p in paths],
                    "verdicts": by_cell[None] if None in by_cell else by_cell})
        return
    for p in paths:
        click.echo(f"wrote {p}")
    if None in by_cell:
        click.echo(table([{"claim": k, "verdict": v} for k, v in by_cell[None].items()]))
    else:
        click.echo(table([{"cell": c, **v} for c, v in by_cell.items()]))
        for row in data.get("sensitivity", []):
            click.echo(f"{row.pop('claim')}: " + "; ".join(
                f"{k}: {v}" for k, v in row.items()))


def _ref(text: str, option: str) -> tuple[str, str | None]:
    """``SWEEP`` or ``SWEEP@DB`` -> (sweep, database or None)."""
    name, at, db = text.partition("@")
    if not name.strip() or (at and not db.strip()):
        raise click.UsageError(f"{option} {text!r}: expected SWEEP or SWEEP@DB, e.g. "
                               f"{option} ladder-e96@e96.db")
    return name.strip(), db.strip() or None
