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
from dataclasses import dataclass
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

if TYPE_CHECKING:
    from qkgeom.store import Store

__all__ = ["ALPHA", "ARM_CLAIMS", "FAILS", "HIGH_CONFIDENCE", "HOLDS", "MIN_SEEDS", "NO_DATA",
           "RULES", "Claim", "ClaimSet", "Report", "Section", "build_report", "compute_claims",
           "compute_report", "render_html", "render_json", "render_markdown", "write_report"]

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


def compute_report(store: Store, sweep: str, *, seed: int = 0, n_boot: int = 10_000,
                   finished_only: bool = True) -> Report:
    """Everything the report of ``sweep`` shows, on the data stored now."""
    fin = finished_only
    found = compute_claims(store, sweep, seed=seed, n_boot=n_boot, finished_only=fin)
    charts = _charts(store, sweep, fin, seed, found.frames)
    design_text, design = _design(store, sweep, fin)
    scale_rows, scale = _scale_rows(store, sweep, fin)
    captions = {"trajectories": TRAJECTORIES_CAPTION}
    captions.update({s.figure: s.caption for s in found.sections if s.figure})
    order = ["trajectories"] + [s.figure for s in found.sections if s.figure]
    figures = [(name, captions.get(name, name)) for name in order if name in charts]
    cells = load_cells()
    ladder = {c.key: robustness(cells, c.key) for c in found.claims}
    return Report(sweep, seed, n_boot, fin, design_text, design, scale_rows, scale,
                  found.claims, found.sections, charts, figures, ladder,
                  found.frames.get("calibration", ""))


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
    return f"{r['summary']} ({FINDINGS})" if r and r["cells"] else "-"


def render_markdown(rep: Report) -> str:
    """report.md: the figures as ``fig-NAME.png`` beside it."""
    md = [f"# qkgeom study report: {rep.sweep}", "", rep.design_text, "",
          _md_table(rep.design), "", "## Scale and optimiser, beside the paper's", "",
          _md_table(rep.scale_rows), "", SCALE_NOTE, "", "## Claims and verdicts", "",
          rep.calibration, "",
          "| claim | paper | measured | verdict | the rule's error rate and power | on the "
          "ladder |", "|---|---|---|---|---|---|"]
    for c in rep.claims:
        md.append(f"| {c.key} | {c.paper} | {c.measured.replace('|', '/')} | **{c.verdict}** "
                  f"| {c.rule_error} | {_ladder_text(rep, c.key)} |")
    md += ["", "Verdict rules:", ""] + [f"- {r}" for r in RULES] + [""]
    md += ["## Figures", ""]
    for name, caption in rep.figures:
        md += [f"![{caption}](fig-{name}.png)", "", f"*{caption}*", ""]
    md += ["## Tables", ""]
    for s in rep.sections:
        md += [f"### {s.title}", ""] + ([s.text, ""] if s.text else [])
        for title, rows in s.tables:
            if title:
                md += [f"*{title}*", ""]
            md += [_md_table(rows), ""]
    return "\n".join(md)


def render_html(rep: Report, svgs: dict[str, str]) -> str:
    """report.html, self-contained: ``svgs`` maps a chart name to its inline ``<svg>``."""
    h = [f"<h1>qkgeom study report: {escape(rep.sweep)}</h1>",
         "<p>" + escape(rep.design_text).replace("**", "") + "</p>",
         html_table(rep.design),
         "<h2>Scale and optimiser, beside the paper's</h2>", html_table(rep.scale_rows),
         f"<p>{escape(SCALE_NOTE)}</p>",
         f"<h2>Claims and verdicts</h2><p>{escape(rep.calibration)}</p>"
         "<table><thead><tr><th>claim</th><th>paper</th>"
         "<th>measured</th><th>verdict</th><th>the rule's error rate and power</th>"
         "<th>on the ladder</th></tr></thead><tbody>"]
    for c in rep.claims:
        h.append(f"<tr><td>{escape(c.key)}</td><td>{escape(c.paper)}</td>"
                 f"<td>{escape(c.measured)}</td>{verdict_cell(c.verdict)}"
                 f"<td>{escape(c.rule_error)}</td>"
                 f"<td>{escape(_ladder_text(rep, c.key))}</td></tr>")
    h.append("</tbody></table><p>Verdict rules:</p><ul>"
             + "".join(f"<li>{escape(r)}</li>" for r in RULES) + "</ul><h2>Figures</h2>")
    for name, caption in rep.figures:
        if name in svgs:
            h.append(f"<figure>{svgs[name]}<figcaption>{escape(caption)}"
                     "</figcaption></figure>")
    if not svgs:
        h.append("<p><em>No figures: the sweep has no plottable data.</em></p>")
    h.append("<h2>Tables</h2>")
    for s in rep.sections:
        h.append(f"<h3>{escape(s.title)}</h3>")
        if s.text:
            h.append(f"<p>{escape(s.text)}</p>")
        for title, rows in s.tables:
            if title:
                h.append(f"<p><em>{escape(title)}</em></p>")
            h.append(html_table(rows))
    return page(f"qkgeom report: {rep.sweep}", "\n".join(h), body_class="doc")


def render_json(rep: Report) -> str:
    """report.json: every number behind the verdicts (strict JSON: NaN as null)."""
    data = {"sweep": rep.sweep, "seed": rep.seed, "n_boot": rep.n_boot,
            "finished_only": rep.finished_only, "scale": rep.scale, "rules": RULES,
            "rules_version": RULES_VERSION,
            "calibration": rep.calibration,
            "claims": [c.__dict__ for c in rep.claims], "ladder": rep.ladder}
    return json.dumps(to_jsonable(data), indent=2, allow_nan=False)


# --------------------------------------------------------------------------- files


def write_report(rep: Report, out: Path) -> list[Path]:
    """Write the figures (PNG for markdown, SVG inline for HTML) and the three renderings
    into the directory ``out``; the paths written, sorted."""
    from qkgeom.report import plots

    svgs: dict[str, str] = {}
    written: list[Path] = []
    for name, chart in rep.charts.items():
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


def build_report(store: Store, sweep: str, out_dir: str | Path, *, seed: int = 0,
                 n_boot: int = 10_000, finished_only: bool = True) -> list[Path]:
    """Compute every claim's verdict for ``sweep`` and write the report into ``out_dir``."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise QkgeomError(f"--out {out} is a file; give a directory for the report")
    out.mkdir(parents=True, exist_ok=True)
    rep = compute_report(store, sweep, seed=seed, n_boot=n_boot, finished_only=finished_only)
    return write_report(rep, out)
