"""The study report: each claim of the paper beside its measured verdict, with plots.

:func:`build_report` writes into one directory:

* ``report.html``: one self-contained page, charts inline as SVG (no scripts, no CDN,
  opens offline);
* ``report.md``: the same text and tables in markdown, with ``fig-*.png`` beside it;
* ``report.json``: every number behind the verdicts.

Everything the report says is computed once, into a :class:`Report` (claims from
:mod:`qkgeom.report.claims`, sections, figures, the study's scale); :func:`render_markdown`,
:func:`render_html` and :func:`render_json` only format that one structure.

Verdicts are ``holds``, ``does not hold`` or ``not enough data``; the rules are spelled out
in :data:`RULES` and printed in the report. Nothing depends on the clock, so the same
database and seed give the same files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qkgeom import analysis as A
from qkgeom.errors import QkgeomError
from qkgeom.records import to_jsonable
from qkgeom.report.claims import (
    ALPHA,
    ARM_CLAIMS,
    FAILS,
    HIGH_CONFIDENCE,
    HOLDS,
    MIN_SEEDS,
    NO_DATA,
    RULES,
    Claim,
    ClaimSet,
    Section,
    compute_claims,
)
from qkgeom.report.html import escape, html_table, page, verdict_cell
from qkgeom.report.ladder import FINDINGS, RULES_VERSION, load_cells, robustness
from qkgeom.report.sensitivity import (
    CellVerdicts,
    Factor,
    across_cells,
    sensitivity_table,
    study_factors,
)

if TYPE_CHECKING:
    from qkgeom.store import Store

__all__ = ["ALPHA", "ARM_CLAIMS", "FAILS", "HIGH_CONFIDENCE", "HOLDS", "MIN_SEEDS", "NO_DATA",
           "RULES", "Claim", "ClaimSet", "Report", "Section", "build_report", "compute_claims",
           "compare_cells", "compute_report", "render_html", "render_json", "render_markdown",
           "write_report"]

TRAJECTORIES_CAPTION = ("PR_Q (solid) and PR_K (dashed) over training per layer, rows = "
                        "depth, columns = initialisation, mean over seeds")


@dataclass
class Report:
    """Everything the report shows, computed once; the renderers only format it."""

    sweep: str
    seed: int
    n_boot: int
    finished_only: bool
    design_text: str  # one paragraph; **bold** marks the sweep name (markdown)
    design: list[dict[str, Any]]  # trials per arm and status, with their mean test loss
    scale_rows: list[dict[str, Any]]  # setting, this study, paper
    scale: dict[str, Any]  # the raw values behind scale_rows
    claims: list[Claim]
    sections: list[Section]
    charts: dict[str, Any]  # name -> altair chart, each written as fig-NAME.png
    figures: list[tuple[str, str]]  # (chart name, caption) in the order shown
    ladder: dict[str, dict[str, Any]]  # claim key -> robustness on the ladder (qkgeom.report.ladder)
    calibration: str = ""  # how the verdict rules were calibrated (the header's line)
    where: str = ""  # the trial filter (--where/--seeds) in words; empty for the whole sweep
    ladder_source: str = FINDINGS  # where the ladder column comes from
    # a sweep with several cells: each cell's own report, the factors and claim x factor
    cells: list[tuple[CellVerdicts, Report]] = field(default_factory=list)
    factors: list[Factor] = field(default_factory=list)
    sensitivity: list[dict[str, Any]] = field(default_factory=list)


# --------------------------------------------------------------------------- computing


def _charts(store: Store, sweep: str, fin: bool, seed: int,
            frames: dict[str, Any]) -> dict[str, Any]:
    from qkgeom.report import plots
    from qkgeom.stats import spearman

    charts: dict[str, Any] = {}
    try:
        charts["trajectories"] = plots.trajectories(A.trajectory_frame(
            store, sweep, finished_only=fin, units=frames.get("units")))
    except QkgeomError:
        pass
    try:
        charts["intervention"] = plots.intervention(A.intervention_frame(store, sweep,
                                                                         finished_only=fin))
    except QkgeomError:
        pass
    try:
        pts = A.correlation_points(store, sweep, x="pr_k", y="entropy", finished_only=fin,
                                   points=frames.get("points"))
        charts["correlation"] = plots.correlation(
            pts, x="pr_k", y="entropy", seed=seed,
            rho=spearman(pts["pr_k"].to_numpy(), pts["entropy"].to_numpy()))
    except QkgeomError:
        pass
    return charts


def _design(store: Store, sweep: str, fin: bool) -> tuple[str, list[dict[str, Any]]]:
    """The design paragraph and the table of trials per arm and status."""
    tr = A.sweep_trials(store, sweep)
    design = tr.group_by(["arm", "status"]).len("trials").sort(["arm", "status"]).to_dicts()
    losses: dict[tuple[str, str], list[float]] = {}
    for r in A.trial_rows(store, sweep):
        if r["test_loss"] is not None:
            losses.setdefault((r["arm"], r["status"]), []).append(r["test_loss"])
    for row in design:  # the final test loss (nats/char), mean over the trials that have one
        tl = losses.get((row["arm"], row["status"]), [])
        row["mean test loss"] = sum(tl) / len(tl) if tl else None
    g = tr.filter(tr["arm"] == A.BASELINE_ARM)
    design_text = (f"Sweep **{sweep}**: {tr.height} trials; depths "
                   f"{sorted(set(g['depth'].to_list()))}, inits "
                   f"{sorted(set(g['init'].to_list()))}, seeds "
                   f"{sorted(set(g['seed'].to_list()))} (paper: depths 4, 6, 8, three inits, "
                   "four seeds = 36 runs, 54 trajectories). Statistics use "
                   + ("terminated trials only." if fin else "all trials, finished or not."))
    return design_text, design


# The paper's side of the scale table (PAPER.md; "reconstructed" = our best reading, the
# values of the paper preset where the abstract is silent).
PAPER_SCALE = {
    "n_embd": "256 (reconstructed)", "n_head": "4 (reconstructed)",
    "block_size": "256 (reconstructed)", "depths": "4, 6, 8",
    "inits": "gaussian, orthogonal, tied", "grid_seeds": "4 (36 runs)",
    "arm_seeds": "5 per arm", "max_steps": "not stated (paper preset: 5000)",
    "batch_size": "not stated (paper preset: 64)", "lr": "about 1e-3 (reconstructed)",
    "min_lr": "cosine decay (paper preset: 1e-4)",
    "warmup": "with warm-up (paper preset: 200 = 4% of training)",
    "weight_decay": "AdamW (paper preset: 0.1)", "betas": "not stated (paper preset: 0.9, 0.99)",
}
SCALE_NOTE = ("Whether a verdict depends on model scale or on the learning rate is what the "
              f"scale x learning-rate ladder measures ({FINDINGS}, studies/*.yaml): the "
              "column 'on the ladder' says, for each claim, whether the ladder's cells saw "
              "its verdict change with the learning rate or with the width; read such a "
              "verdict of a small study as a property of its setting, not of the paper.")


def _scale_rows(store: Store, sweep: str, fin: bool) -> tuple[list[dict[str, Any]],
                                                            dict[str, Any]]:
    """Rows (setting, this study, paper) for the report header, and the raw values."""
    sc = A.study_scale(store, sweep, finished_only=fin)

    def show(v: Any) -> str:
        if isinstance(v, list):
            return ", ".join(show(x) for x in v) if v else "-"
        if isinstance(v, tuple):
            return "(" + ", ".join(show(x) for x in v) + ")"
        return A.fmt(v, 4) if isinstance(v, float) and abs(v) < 1e-2 else str(v)

    rows = [{"setting": "depths (n_layer)", "this study": show(sc["depths"]),
             "paper": PAPER_SCALE["depths"]},
            {"setting": "Q/K inits", "this study": show(sc["inits"]),
             "paper": PAPER_SCALE["inits"]}]
    rows += [{"setting": label, "this study": show(sc[key]), "paper": PAPER_SCALE[key]}
             for key, label in A.SCALE_KEYS]
    rows.append({"setting": "grid seeds", "this study": show(sc["grid_seeds"]),
                 "paper": PAPER_SCALE["grid_seeds"]})
    for arm, seeds in sc["arm_seeds"].items():
        rows.append({"setting": f"seeds of arm {arm}", "this study":
                     f"{len(seeds)} ({show(seeds)})", "paper": PAPER_SCALE["arm_seeds"]})
    return rows, sc


def compute_report(store: Store, sweep: str | A.Scope, *, seed: int = 0, n_boot: int = 10_000,
                   finished_only: bool = True) -> Report:
    """Everything the report of ``sweep`` (a name or a filtered scope) shows, on the data
    stored now; a sweep with several cells is decided cell by cell
    (:func:`compare_cells`)."""
    cells = A.cells_of(store, sweep)
    if len(cells) > 1:
        return compare_cells(store, sweep, cells, seed=seed, n_boot=n_boot,
                             finished_only=finished_only)
    fin = finished_only
    found = compute_claims(store, sweep, seed=seed, n_boot=n_boot, finished_only=fin)
    charts = _charts(store, sweep, fin, seed, found.frames)
    design_text, design = _design(store, sweep, fin)
    scale_rows, scale = _scale_rows(store, sweep, fin)
    captions = {"trajectories": TRAJECTORIES_CAPTION}
    captions.update({s.figure: s.caption for s in found.sections if s.figure})
    order = ["trajectories"] + [s.figure for s in found.sections if s.figure]
    figures = [(name, captions.get(name, name)) for name in order if name in charts]
    ladder_cells = load_cells()
    ladder = {c.key: robustness(ladder_cells, c.key) for c in found.claims}
    return Report(A.sweep_name(sweep), seed, n_boot, fin, design_text, design, scale_rows,
                  scale, found.claims, found.sections, charts, figures, ladder,
                  found.frames.get("calibration", ""), where=_where(sweep))


def _where(sweep: str | A.Scope) -> str:
    return sweep.describe() if isinstance(sweep, A.Scope) else ""


def compare_cells(store: Store, sweep: str | A.Scope, cells: list[str], *, seed: int = 0,
                  n_boot: int = 10_000, finished_only: bool = True) -> Report:
    """The report of a sweep with several cells: every claim decided on each cell's trials
    alone (a full report per cell), the verdicts side by side, and the sensitivity table
    (claim x factor, :mod:`qkgeom.report.sensitivity`); each cell's 'across cells' column
    says how its claim fares over the cells instead of the ladder file."""
    scope = sweep if isinstance(sweep, A.Scope) else A.Scope(sweep)
    rows = A.trial_rows(store, scope)
    configs = {c: [r["config"] for r in rows if r["cell"] == c] for c in cells}
    factors, values = study_factors(configs)
    subs = [(c, compute_report(store, scope.narrow(cell=c), seed=seed, n_boot=n_boot,
                               finished_only=finished_only)) for c in cells]
    verdicts = [CellVerdicts(c, values[c], {k.key: k.verdict for k in rep.claims})
                for c, rep in subs]
    keys = list(dict.fromkeys(k.key for _, rep in subs for k in rep.claims))
    for _, rep in subs:
        rep.ladder_source = ""
        rep.ladder = {k: {"summary": across_cells(verdicts, k, factors),
                          "cells": {v.label: v.verdicts.get(k) for v in verdicts}}
                      for k in keys}
    design_text, design = _design(store, scope, finished_only)
    scale_rows, scale = _scale_rows(store, scope, finished_only)
    return Report(scope.name, seed, n_boot, finished_only, design_text, design, scale_rows,
                  scale, [], [], {}, [], {}, subs[0][1].calibration, where=_where(scope),
                  cells=[(cv, rep) for cv, (_, rep) in zip(verdicts, subs)],
                  factors=factors, sensitivity=sensitivity_table(verdicts, keys, factors))


def cell_rows(rep: Report) -> list[dict[str, Any]]:
    """One row per cell: its label, factor values and each claim's verdict."""
    return [{"cell": cv.label, **{f.label: cv.factors.get(f.name) for f in rep.factors},
             **cv.verdicts} for cv, _ in rep.cells]


# --------------------------------------------------------------------------- rendering


def _md_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "_(no rows)_"
    cols = list(dict.fromkeys(k for r in rows for k in r))
    out = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        out.append("| " + " | ".join(A.fmt(r.get(c)).replace("|", "/") for c in cols) + " |")
    return "\n".join(out)


def _ladder_text(rep: Report, key: str) -> str:
    r = rep.ladder.get(key)
    if not r or not r["cells"]:
        return "-"
    return f"{r['summary']} ({rep.ladder_source})" if rep.ladder_source else r["summary"]


def _ladder_head(rep: Report) -> str:
    return "on the ladder" if rep.ladder_source else "across the cells"


SENSITIVITY_NOTE = ("Each cell's claims are decided on that cell's trials alone. A factor "
                    "'flips' a claim where two cells that differ only in that factor have "
                    "different decided verdicts (at the other factors' values shown); "
                    "'stable' counts such comparisons that agree; 'not compared' means no "
                    "two cells with decided verdicts differ in that factor alone. Factors "
                    "that change together in every cell count as one.")


def _heading(rep: Report) -> str:
    return rep.sweep + (f" [{rep.where}]" if rep.where else "")


def render_markdown(rep: Report) -> str:
    """report.md: the figures as ``fig-NAME.png`` beside it."""
    md = [f"# qkgeom study report: {_heading(rep)}", "", rep.design_text, "",
          _md_table(rep.design), "", "## Scale and optimiser, beside the paper's", "",
          _md_table(rep.scale_rows), "", SCALE_NOTE, ""]
    if not rep.cells:
        return "\n".join(md + _md_claims(rep, "##", ""))
    md += [f"## Verdicts by cell ({len(rep.cells)} cells)", "", rep.calibration, "",
           _md_table(cell_rows(rep)), "", "## Sensitivity: claim x factor", "",
           SENSITIVITY_NOTE, "", _md_table(rep.sensitivity), ""]
    for cv, sub in rep.cells:
        md += [f"## Cell {cv.label}", "", sub.design_text, "", _md_table(sub.design), ""]
        md += _md_claims(sub, "###", f"{cv.label}-")
    return "\n".join(md)


def _md_claims(rep: Report, h: str, fig: str) -> list[str]:
    md = [f"{h} Claims and verdicts", "", rep.calibration, "",
          "| claim | paper | measured | verdict | the rule's error rate and power | "
          f"{_ladder_head(rep)} |", "|---|---|---|---|---|---|"]
    for c in rep.claims:
        md.append(f"| {c.key} | {c.paper} | {c.measured.replace('|', '/')} | **{c.verdict}** "
                  f"| {c.rule_error} | {_ladder_text(rep, c.key)} |")
    md += ["", "Verdict rules:", ""] + [f"- {r}" for r in RULES] + [""]
    md += [f"{h} Figures", ""]
    for name, caption in rep.figures:
        md += [f"![{caption}](fig-{fig}{name}.png)", "", f"*{caption}*", ""]
    md += [f"{h} Tables", ""]
    for s in rep.sections:
        md += [f"{h}# {s.title}", ""] + ([s.text, ""] if s.text else [])
        for title, rows in s.tables:
            if title:
                md += [f"*{title}*", ""]
            md += [_md_table(rows), ""]
    return md


def render_html(rep: Report, svgs: dict[str, str]) -> str:
    """report.html, self-contained: ``svgs`` maps a chart name (``CELL-NAME`` in a cell)
    to its inline ``<svg>``."""
    h = [f"<h1>qkgeom study report: {escape(_heading(rep))}</h1>",
         "<p>" + escape(rep.design_text).replace("**", "") + "</p>",
         html_table(rep.design),
         "<h2>Scale and optimiser, beside the paper's</h2>", html_table(rep.scale_rows),
         f"<p>{escape(SCALE_NOTE)}</p>"]
    if not rep.cells:
        h += _html_claims(rep, 2, "", svgs)
    else:
        h += [f"<h2>Verdicts by cell ({len(rep.cells)} cells)</h2>",
              f"<p>{escape(rep.calibration)}</p>", html_table(cell_rows(rep), verdicts=True),
              "<h2>Sensitivity: claim x factor</h2>", f"<p>{escape(SENSITIVITY_NOTE)}</p>",
              html_table(rep.sensitivity)]
        for cv, sub in rep.cells:
            h += [f"<h2>Cell {escape(cv.label)}</h2>",
                  "<p>" + escape(sub.design_text).replace("**", "") + "</p>",
                  html_table(sub.design)]
            h += _html_claims(sub, 3, f"{cv.label}-", svgs)
    return page(f"qkgeom report: {_heading(rep)}", "\n".join(h), body_class="doc")


def _html_claims(rep: Report, level: int, fig: str, svgs: dict[str, str]) -> list[str]:
    hn, hs = f"h{level}", f"h{level + 1}"
    h = [f"<{hn}>Claims and verdicts</{hn}><p>{escape(rep.calibration)}</p>"
         "<table><thead><tr><th>claim</th><th>paper</th>"
         "<th>measured</th><th>verdict</th><th>the rule's error rate and power</th>"
         f"<th>{escape(_ladder_head(rep))}</th></tr></thead><tbody>"]
    for c in rep.claims:
        h.append(f"<tr><td>{escape(c.key)}</td><td>{escape(c.paper)}</td>"
                 f"<td>{escape(c.measured)}</td>{verdict_cell(c.verdict)}"
                 f"<td>{escape(c.rule_error)}</td>"
                 f"<td>{escape(_ladder_text(rep, c.key))}</td></tr>")
    h.append("</tbody></table><p>Verdict rules:</p><ul>"
             + "".join(f"<li>{escape(r)}</li>" for r in RULES) + f"</ul><{hn}>Figures</{hn}>")
    shown = 0
    for name, caption in rep.figures:
        if fig + name in svgs:
            shown += 1
            h.append(f"<figure>{svgs[fig + name]}<figcaption>{escape(caption)}"
                     "</figcaption></figure>")
    if not shown:
        h.append("<p><em>No figures: the sweep has no plottable data.</em></p>")
    h.append(f"<{hn}>Tables</{hn}>")
    for s in rep.sections:
        h.append(f"<{hs}>{escape(s.title)}</{hs}>")
        if s.text:
            h.append(f"<p>{escape(s.text)}</p>")
        for title, rows in s.tables:
            if title:
                h.append(f"<p><em>{escape(title)}</em></p>")
            h.append(html_table(rows))
    return h


def _json_claims(rep: Report) -> dict[str, Any]:
    return {"claims": [c.__dict__ for c in rep.claims], "ladder": rep.ladder}


def render_json(rep: Report) -> str:
    """report.json: every number behind the verdicts (strict JSON: NaN as null)."""
    data = {"sweep": rep.sweep, "where": rep.where or None, "seed": rep.seed,
            "n_boot": rep.n_boot, "finished_only": rep.finished_only, "scale": rep.scale,
            "rules": RULES, "rules_version": RULES_VERSION, "calibration": rep.calibration,
            **_json_claims(rep)}
    if rep.cells:
        data["factors"] = [{"name": f.name, "with": list(f.partners)} for f in rep.factors]
        data["cells"] = [{"label": cv.label, "factors": cv.factors, **_json_claims(sub)}
                         for cv, sub in rep.cells]
        data["sensitivity"] = rep.sensitivity
    return json.dumps(to_jsonable(data), indent=2, allow_nan=False)


# --------------------------------------------------------------------------- files


def write_report(rep: Report, out: Path) -> list[Path]:
    """Write the figures (PNG for markdown, SVG inline for HTML) and the three renderings
    into the directory ``out``; the paths written, sorted."""
    from qkgeom.report import plots

    svgs: dict[str, str] = {}
    written: list[Path] = []
    charts = dict(rep.charts)
    for cv, sub in rep.cells:
        charts.update({f"{cv.label}-{name}": chart for name, chart in sub.charts.items()})
    for name, chart in charts.items():
        png = out / f"fig-{name}.png"
        png.write_bytes(plots.to_png(chart))
        written.append(png)
        svg = plots.to_svg(chart)
        svgs[name] = svg[svg.find("<svg"):] if "<svg" in svg else svg
    for name, text in (("report.md", render_markdown(rep)),
                       ("report.html", render_html(rep, svgs)),
                       ("report.json", render_json(rep))):
        (out / name).write_text(text, encoding="utf-8")
        written.append(out / name)
    return sorted(written)


def build_report(store: Store, sweep: str | A.Scope, out_dir: str | Path, *, seed: int = 0,
                 n_boot: int = 10_000, finished_only: bool = True) -> list[Path]:
    """Compute every claim's verdict for ``sweep`` and write the report into ``out_dir``."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise QkgeomError(f"--out {out} is a file; give a directory for the report")
    out.mkdir(parents=True, exist_ok=True)
    rep = compute_report(store, sweep, seed=seed, n_boot=n_boot, finished_only=finished_only)
    return write_report(rep, out)
