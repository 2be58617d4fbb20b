"""Pieces of the live page that need no server state: the sweep's header, the arms, the
trajectories chart, and the factor view of a sweep with cells (group and filter the trials
by any factor)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, urlencode

import polars as pl

from qkgeom.analysis.scope import value_order
from qkgeom.errors import QkgeomError
from qkgeom.report.html import escape as _e
from qkgeom.report.html import html_table
from qkgeom.report.study import Study

PRQK = "pr_q,pr_k"  # the default chart: the project's PR_Q / PR_K trajectories


def sweep_url(name: str, page: str = "", query: str = "") -> str:
    """The address of sweep ``name``'s page, or of one of its downloads (``page``, e.g.
    ``trials.csv``), with the query string ``query``: ``/sweeps/NAME/PAGE?QUERY`` with the
    name as one path segment (every character but letters, digits and ``_.-~`` quoted:
    ``a/b`` -> ``a%2Fb``). A name of dots only (``.``, ``..``; or empty) would be a dot
    segment that browsers resolve away: ``/sweep/PAGE?name=NAME&QUERY`` instead."""
    tail = f"/{page}" if page else ""
    if not name.strip("."):
        return f"/sweep{tail}?" + urlencode({"name": name}) + (f"&{query}" if query else "")
    return f"/sweeps/{quote(name, safe='')}{tail}" + (f"?{query}" if query else "")


def trajectories_svg(st: Study, metric: str, view: str, ids: list[int] | None
                     ) -> tuple[str, str]:
    """(svg, note): the trajectories chart of ``metric`` (PRQK: PR_Q and PR_K) as inline
    SVG, mean over seeds or per trial (``view``), of the trials ``ids`` (None: all), or
    an empty string and why there is none."""
    from qkgeom.report import plots

    try:
        if metric == PRQK:
            ch = st.chart("trajectories", per_trial=view == "trial", finished_only=False,
                          trials=ids)
        else:
            ch = st.chart("metric", metric=metric, per_trial=view == "trial",
                          finished_only=False, trials=ids)
    except QkgeomError as e:
        return "", str(e)
    svg = plots.to_svg(ch)
    return svg[svg.find("<svg"):], ""


def sweep_header(st: Study, prog: dict[str, Any]) -> str:
    """Navigation, title and the progress line of a sweep's page."""
    def href(page: str) -> str:
        return _e(sweep_url(st.name, page))

    provisional = not prog["finished"]
    return (f"<nav><a href='/'>all sweeps</a><a href='{href('report.html')}'>report"
            f"</a><a href='{href('trials.csv')}'>trials.csv</a>"
            f"<a href='{href('trials.parquet')}'>trials.parquet</a>"
            f"<a href='{href('claims.json')}'>claims.json</a></nav>"
            f"<h1>sweep {_e(st.name)}</h1>"
            f"<p id='progress'><progress value='{prog['fraction']:.4f}' max='1'></progress> "
            f"{prog['fraction']:.1%} of training done; {prog['n_trials']} trials: "
            f"{_e(counts(prog['status']))}"
            + (f" <span class='s-stale'>({prog['stale']} running without a heartbeat: "
               "the driver is gone?)</span>" if prog.get("stale") else "")
            + ("" if not provisional else " (study running or incomplete: verdicts are "
               "provisional)") + "</p>")


def arms_section(arms: pl.DataFrame) -> str:
    if not arms.height:
        return ""
    return ("<h2>Arms beside their baselines</h2><p class='note'>Latest probe, mean "
            "over layers; pr_wk = achieved W_K weight PR, pr_k = key PR_K; baseline_* "
            "= the arm-none trial of the same depth, init and seed.</p>"
            + html_table(arms.to_dicts(), table_id="arms"))


def counts(status: dict[str, int]) -> str:
    return ", ".join(f"{n} {s}" for s, n in sorted(status.items())) or "no trials yet"


def reload_note(refresh: int) -> str:
    return (f"This page reloads every {refresh} s (add ?refresh=0 to stop)." if refresh
            else "Automatic reloading is off.")


class BadRequest(QkgeomError):
    """A bad query parameter: answered with 400 and the message."""


FILTER = "f."  # query parameters f.FACTOR=VALUE keep the trials with that value


def _text(v: Any) -> str:
    return "" if v is None else (f"{v:g}" if isinstance(v, float) else str(v))


def filter_trials(st: Study, trials: pl.DataFrame, query: Mapping[str, str]
                  ) -> tuple[pl.DataFrame, dict[str, str], str | None]:
    """The trials kept by the query's ``f.FACTOR=VALUE`` filters, the filters, and the
    ``group=FACTOR`` asked for (None when absent). Factors are those of
    :meth:`Study.factors` and ``cell``; anything else is a :class:`BadRequest`."""
    names = [*st.factors(), "cell"] if "cell" in trials.columns else []
    filters = {k[len(FILTER):]: v for k, v in query.items() if k.startswith(FILTER) and v}
    group = query.get("group") or None
    for name in [*filters, *([group] if group else [])]:
        if name not in names:
            have = ", ".join(names) if names else "none (the sweep has no cells)"
            raise BadRequest(f"{name!r} is not a factor of sweep {st.name!r}; factors: {have}")
    for name, value in filters.items():
        trials = trials.filter(pl.col(name).map_elements(_text, return_dtype=pl.String)
                               == value)
    return trials, filters, group


Kept = tuple[dict[str, str], list[int] | None]


def kept_trials(trials: pl.DataFrame, filters: dict[str, str]) -> Kept:
    """What a chart or download of the filtered page draws: the filters and the ids of
    the trials they keep (None without filters: every trial, also those that start later)."""
    return filters, (trials["trial_id"].to_list() if filters else None)


def factor_section(st: Study, trials: pl.DataFrame, filters: dict[str, str],
                   group: str | None, query: dict[str, str]) -> str:
    """A sweep with cells: a form to group and filter by any factor, the trials grouped by
    the chosen factor (count, finished, mean test loss, claim 2's final gap) and the gap
    per layer faceted by it. Empty for a sweep without cells."""
    factors = st.factors()
    if not factors:
        return ""
    group = group or factors[0]
    every = st.factor_frame()
    keep = "".join(f"<input type='hidden' name='{_e(k)}' value='{_e(v)}'>"
                   for k, v in query.items() if k != "group" and not k.startswith(FILTER))
    sel = "".join(f"<option value='{_e(f)}'{' selected' if f == group else ''}>{_e(f)}"
                  "</option>" for f in [*factors, "cell"])
    boxes = []
    for f in [*factors, "cell"]:
        vals = sorted({_text(v) for v in every[f].to_list()}, key=value_order)
        opts = "<option value=''>all</option>" + "".join(
            f"<option{' selected' if filters.get(f) == v else ''}>{_e(v)}</option>"
            for v in vals)
        boxes.append(f"<label>{_e(f)} <select name='{FILTER}{_e(f)}'>{opts}</select></label>")
    form = (f"<form method='get' id='factor-form'>{keep}<label>group by <select "
            f"name='group'>{sel}</select></label> {' '.join(boxes)} "
            "<button type='submit'>show</button></form>")
    ids = trials["trial_id"].to_list()
    gap = st.gap_frame(finished_only=False).filter(pl.col("trial_id").is_in(ids))
    rows = _grouped(trials, gap, group)
    chart = ""
    if gap.height:
        from qkgeom.report import plots

        svg = plots.to_svg(plots.final_gap(gap, facet=group))
        chart = f"<figure id='factor-chart'>{svg[svg.find('<svg'):]}</figure>"
    shown = "; ".join(f"{k}={v}" for k, v in filters.items()) or "all trials"
    return ("<h2>By factor</h2><p class='note'>Cells differ in "
            f"{_e(', '.join(factors))}. Shown: {_e(shown)}, grouped by {_e(group)}; the gap "
            "is PR_Q - PR_K of the baseline trials at their latest probe (finished or not). "
            "The filters apply to this section and the trial table."
            f"</p>{form}" + html_table(rows, table_id="by-factor") + chart)


def _grouped(trials: pl.DataFrame, gap: pl.DataFrame, group: str) -> list[dict[str, Any]]:
    t = trials.group_by(group).agg(
        pl.len().alias("trials"), (pl.col("status") == "terminated").sum().alias("finished"),
        pl.col("test_loss").drop_nans().mean().alias("mean test loss"))
    if gap.height:
        g = gap.group_by(group).agg(
            pl.col("value").mean().alias("mean PR_Q - PR_K (final)"),
            ((pl.col("value") > 0).sum().cast(pl.String) + " of "
             + pl.len().cast(pl.String)).alias("PR_Q > PR_K (trial, layer)"))
        t = t.join(g, on=group, how="left")
    return sorted(t.to_dicts(), key=lambda r: value_order(_text(r[group])))

