"""The study report: each claim of the paper beside its measured verdict, with plots.

:func:`build_report` writes into one directory:

* ``report.html``: one self-contained page, charts inline as SVG (no scripts, no CDN,
  opens offline);
* ``report.md``: the same text and tables in markdown, with ``fig-*.png`` beside it;
* ``report.json``: every number behind the verdicts.

Everything the report says is computed once, into a :class:`Report` (claims from
:mod:`qkgeom.report.claims`, sections, figures, the study's scale); :func:`render_markdown`,
:func:`render_html` and :func:`render_json` only format that one structure.

Verdicts are ``holds``, ``not shown``, ``contradicted`` or ``not enough data``; the rules are spelled out
in :data:`RULES` and printed in the report. Nothing depends on the clock, so the same
database and seed give the same files.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qkgeom import analysis as A
from qkgeom.errors import QkgeomError
from qkgeom.records import to_jsonable
from qkgeom.report.claims import (
    ALPHA,
    ARM_CLAIMS,
    CONTRADICTED,
    HIGH_CONFIDENCE,
    HOLDS,
    MIN_SEEDS,
    NO_DATA,
    NOT_SHOWN,
    RULES,
    Claim,
    ClaimSet,
    Section,
    compute_claims,
)
from qkgeom.report.compare import (
    FINAL_GAP_CAPTION,
    FINDINGS,
    GLANCE_NOTE,
    RULES_VERSION,
    SEEDS_NOTE,
    as_scope,
    cells_chart,
    column,
    comparison_parts,
    decide_cells,
    glance,
    glance_rows,
    part_factors,
    seed_rows,
)
from qkgeom.report.html import escape, html_table, page, verdict_cell
from qkgeom.report.sensitivity import CellVerdicts, Factor, sensitivity_table

if TYPE_CHECKING:
    from qkgeom.store import Store

__all__ = ["ALPHA", "ARM_CLAIMS", "CONTRADICTED", "NOT_SHOWN", "HIGH_CONFIDENCE", "HOLDS", "MIN_SEEDS", "NO_DATA",
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
    # claim key -> how the claim fares over other cells (qkgeom.report.compare.column): the
    # ladder's (--ladder) in a one-cell report, the report's own cells' in a comparison;
    # empty when there is nothing to compare with
    ladder: dict[str, dict[str, Any]]
    calibration: str = ""  # how the verdict rules were calibrated (the header's line)
    where: str = ""  # the trial filter (--where/--seeds) in words; empty for the whole sweep
    ladder_source: str = ""  # the sweeps of the ladder column; empty: the report's own cells
    # a sweep with several cells: each cell's own report, the factors and claim x factor
    cells: list[tuple[CellVerdicts, Report]] = field(default_factory=list)
    # each cell's facts and per-seed grid verdicts (qkgeom.report.compare.glance)
    glance: dict[str, dict[str, Any]] = field(default_factory=dict)
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
              f"scale x learning-rate ladder measures ({FINDINGS}, studies/ladder.yaml): "
              "with `qkgeom report --ladder SWEEP`, the column 'on the ladder' says, for each "
              "claim, how that sweep's cells, decided here under the same rules, came out "
              "and which factor (width, learning rate, ...) flips the verdict; read a "
              "verdict that flips as a property of its setting, not of the paper.")


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
    rows += code_rows(store, A.sweep_name(sweep))
    return rows, sc


def code_rows(store: Store, sweep: str) -> list[dict[str, Any]]:
    """Rows (setting, this study, paper) for the code that trained the sweep: each
    distinct qkgeom version and git commit of its trials' latest attempts, with how many
    trials ran it, then the Python/torch/Ray/CUDA versions and the hosts
    (``trial_attempts``; none for a database without attempts)."""
    att = store.attempts(sweep)
    if att.height == 0:
        return []
    latest = att.sort(["trial_id", "attempt"]).unique("trial_id", keep="last",
                                                      maintain_order=True)

    def counted(values: list[str]) -> str:
        seen: dict[str, int] = {}
        for v in values:
            seen[v] = seen.get(v, 0) + 1
        return "; ".join(f"{v} ({n} trial{'s' if n != 1 else ''})" for v, n in seen.items())

    code = [f"{r['code_version'] or '?'}" + (
        f" @ {r['git_commit'][:12]}{' (uncommitted changes)' if r['git_dirty'] else ''}"
        if r["git_commit"] else " (no git checkout)") for r in latest.iter_rows(named=True)]
    vers = [", ".join(f"{k} {r[k] or '-'}" for k in ("python", "torch", "ray", "cuda"))
            for r in latest.iter_rows(named=True)]
    hosts = [r["host"] or "?" for r in latest.iter_rows(named=True)]
    return [{"setting": "code (qkgeom @ git commit)", "this study": counted(sorted(code)),
             "paper": "-"},
            {"setting": "Python, torch, Ray, CUDA", "this study": counted(sorted(vers)),
             "paper": "-"},
            {"setting": "hosts", "this study": counted(sorted(hosts)), "paper": "-"}]


def compute_report(store: Store, sweep: str | A.Scope, *, compare: Sequence[str | A.Scope] = (),
                   ladder: Sequence[str | A.Scope] = (), seed: int = 0, n_boot: int = 10_000,
                   finished_only: bool = True) -> Report:
    """Everything the report of ``sweep`` (a name or a filtered scope) shows, on the data
    stored now. A sweep with several cells, or a sweep with ``compare`` sweeps, is decided
    cell by cell (:func:`compare_cells`); a one-cell report with ``ladder`` sweeps gets the
    column 'on the ladder' from their cells (:mod:`qkgeom.report.compare`)."""
    parts = comparison_parts(store, [sweep, *compare])
    if len(parts) > 1:
        return compare_cells(store, parts, seed=seed, n_boot=n_boot,
                             finished_only=finished_only)
    sweep = parts[0][1] if parts[0][1].filtered else sweep
    fin = finished_only
    found = compute_claims(store, sweep, seed=seed, n_boot=n_boot, finished_only=fin)
    charts = _charts(store, sweep, fin, seed, found.frames)
    design_text, design = _design(store, sweep, fin)
    scale_rows, scale = _scale_rows(store, sweep, fin)
    captions = {"trajectories": TRAJECTORIES_CAPTION}
    captions.update({s.figure: s.caption for s in found.sections if s.figure})
    order = ["trajectories"] + [s.figure for s in found.sections if s.figure]
    figures = [(name, captions.get(name, name)) for name in order if name in charts]
    rep = Report(A.sweep_name(sweep), seed, n_boot, fin, design_text, design, scale_rows,
                 scale, found.claims, found.sections, charts, figures, {},
                 found.frames.get("calibration", ""), where=_where(sweep))
    if ladder:  # the report's own sweep is one of the ladder's cells unless already in it
        parts = comparison_parts(store, ladder)
        names = [as_scope(s).name for s in ladder]
        own = A.sweep_name(sweep)
        known = {}
        if own not in names:
            parts = [(own, as_scope(sweep)), *parts]
            known[own] = {c.key: c.verdict for c in found.claims}
            names = ["this sweep", *names]
        factors, verdicts = decide_cells(store, parts, seed=seed, n_boot=n_boot,
                                         finished_only=fin, decided=known)
        rep.ladder = column(verdicts, factors, [c.key for c in found.claims])
        rep.ladder_source = ", ".join(names)
    return rep


def _where(sweep: str | A.Scope) -> str:
    return sweep.describe() if isinstance(sweep, A.Scope) else ""


def compare_cells(store: Store, parts: Sequence[tuple[str, A.Scope]], *, seed: int = 0,
                  n_boot: int = 10_000, finished_only: bool = True) -> Report:
    """The report of several cells (the cells of a sweep, or several sweeps): every claim
    decided on each cell's trials alone (a full report per cell), the verdicts side by
    side, and the sensitivity table (claim x factor, :mod:`qkgeom.report.sensitivity`);
    each cell's 'across the cells' column says how its claim fares over the cells."""
    factors, values = part_factors(store, parts)
    subs = [(label, compute_report(store, scope, seed=seed, n_boot=n_boot,
                                   finished_only=finished_only)) for label, scope in parts]
    verdicts = [CellVerdicts(c, values[c], {k.key: k.verdict for k in rep.claims})
                for c, rep in subs]
    keys = list(dict.fromkeys(k.key for _, rep in subs for k in rep.claims))
    for _, rep in subs:
        rep.ladder = column(verdicts, factors, keys)
    wholes = list(dict.fromkeys(_whole(p) for _, p in parts))  # each sweep, cells pooled
    if len(wholes) == 1:  # the sweep's cells: its design, filtered as the cells are
        design_text, design = _design(store, wholes[0], finished_only)
        scale_rows, scale = _scale_rows(store, wholes[0], finished_only)
    else:
        design_text, design, scale_rows, scale = _designs(store, wholes, finished_only)
    title = " vs ".join(w.name for w in wholes)
    where = "; ".join(dict.fromkeys(_where(w) for w in wholes if w.filtered))
    charts = cells_chart(store, parts, finished_only)
    figures = [("final-gap", FINAL_GAP_CAPTION)] if charts else []
    return Report(title, seed, n_boot, finished_only, design_text, design, scale_rows,
                  scale, [], [], charts, figures, {}, subs[0][1].calibration, where=where,
                  cells=[(cv, rep) for cv, (_, rep) in zip(verdicts, subs)],
                  factors=factors, sensitivity=sensitivity_table(verdicts, keys, factors),
                  glance=glance(store, parts, seed=seed, finished_only=finished_only))


def _whole(scope: A.Scope) -> A.Scope:
    """The scope's sweep with its filter but without the cell condition."""
    return A.Scope(scope.name, tuple(w for w in scope.where if w[0] != "cell"), scope.seeds)


def _designs(store: Store, wholes: Sequence[A.Scope], fin: bool
             ) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """Design and scale of a comparison of several sweeps: one row group (design) and one
    column (scale) per sweep."""
    design: list[dict[str, Any]] = []
    scale_cols: dict[str, list[dict[str, Any]]] = {}
    scale: dict[str, Any] = {}
    sweeps = [w.name for w in wholes]
    for scope in wholes:
        design += [{"sweep": scope.name, **r} for r in _design(store, scope, fin)[1]]
        scale_cols[scope.name], scale[scope.name] = _scale_rows(store, scope, fin)
    settings = list(dict.fromkeys(r["setting"] for rows in scale_cols.values() for r in rows))
    paper = {r["setting"]: r["paper"] for rows in scale_cols.values() for r in rows}
    scale_rows = [{"setting": st, **{n: next((r["this study"] for r in scale_cols[n]
                                              if r["setting"] == st), "-") for n in sweeps},
                   "paper": paper[st]} for st in settings]
    n = sum(r["trials"] for r in design)
    text = (f"Comparison of the sweeps **{'**, **'.join(sweeps)}**: "
            f"{n} trials. Each cell's claims are decided on its own trials. Statistics use "
            + ("terminated trials only." if fin else "all trials, finished or not."))
    return text, design, scale_rows, scale


def cell_rows(rep: Report) -> list[dict[str, Any]]:
    """One row per cell: its label, factor values and each claim's verdict."""
    return [{"cell": cv.label, **{f.label: cv.factors.get(f.name) for f in rep.factors},
             **cv.verdicts} for cv, _ in rep.cells]


# --------------------------------------------------------------------------- rendering


_MD_PUNCT = re.compile(r"([\\`*_\[\]|#~])")
_MD_ENTITIES = {"&": "&amp;", "<": "&lt;", ">": "&gt;"}


def md_name(text: str) -> str:
    """A name (a sweep's, a cell's, a filter) as literal markdown text: HTML's ``& < >``
    as entities, markdown's punctuation (``\\ ` * _ [ ] | # ~``) backslash-escaped, line
    breaks as spaces, so no name can open a tag, a link, emphasis or a table cell."""
    out = "".join(_MD_ENTITIES.get(c, c) for c in str(text))
    out = _MD_PUNCT.sub(r"\\\1", out)
    return " ".join(out.splitlines()) if "\n" in out or "\r" in out else out


def md_bold_text(text: str) -> str:
    """A paragraph whose ``**`` pairs bold names (the design text): each piece escaped by
    :func:`md_name`, the pairs kept."""
    return "**".join(md_name(part) for part in text.split("**"))


_TAG_START = re.compile(r"<(?=[A-Za-z/!?])")  # what would open raw HTML or an autolink
_LINK = re.compile(r"\]\((?!fig-[A-Za-z0-9._-]+\.png\))")  # an inline link, not a figure


def safe_markdown(md: str) -> str:
    """The last pass over report.md: no raw HTML (every ``<`` that could open a tag is
    ``&lt;``) and no inline link but the report's own figures, whatever a stored string
    (a model's name, a message) held. Numbers and words read as before (``p < 0.05``)."""
    return _LINK.sub(r"]\\(", _TAG_START.sub("&lt;", md))


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
    return r["summary"] if r and r["cells"] else "-"


def _ladder_head(rep: Report) -> str:
    if rep.ladder_source:
        return f"on the ladder ({rep.ladder_source})"
    return "across the cells" if rep.ladder else "on the ladder (--ladder SWEEP)"


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
    md = [f"# qkgeom study report: {md_name(_heading(rep))}", "", md_bold_text(rep.design_text), "",
          _md_table(rep.design), "", "## Scale and optimiser, beside the paper's", "",
          _md_table(rep.scale_rows), "", SCALE_NOTE, ""]
    if not rep.cells:
        return safe_markdown("\n".join(md + _md_claims(rep, "##", "")))
    md += [f"## Verdicts by cell ({len(rep.cells)} cells)", "", rep.calibration, "",
           _md_table(cell_rows(rep)), "", "## Sensitivity: claim x factor", "",
           SENSITIVITY_NOTE, "", _md_table(rep.sensitivity), ""]
    for name, caption in rep.figures:
        md += [f"![{caption}](fig-{name}.png)", "", f"*{caption}*", ""]
    md += ["## Cells at a glance", "",
           GLANCE_NOTE, "", _md_table(glance_rows(rep.glance)), "", "## Seed stability", "",
           SEEDS_NOTE, "", _md_table(seed_rows([cv for cv, _ in rep.cells], rep.glance)), ""]
    for cv, sub in rep.cells:
        md += [f"## Cell {md_name(cv.label)}", "", md_bold_text(sub.design_text), "",
               _md_table(sub.design), ""]
        md += _md_claims(sub, "###", f"{_slug(cv.label)}-")
    return safe_markdown("\n".join(md))


def _design_text(c: Claim) -> str:
    """The rule's false-holds rate and power at the design this verdict rests on."""
    return f"false holds {c.size}; power {c.power}" if c.size else "-"


def _md_claims(rep: Report, h: str, fig: str) -> list[str]:
    md = [f"{h} Claims and verdicts", "", rep.calibration, "",
          "| claim | paper | measured | verdict | at this design | the rule's calibration | "
          f"{_ladder_head(rep)} |", "|---|---|---|---|---|---|---|"]
    for c in rep.claims:
        md.append(f"| {c.key} | {c.paper} | {c.measured.replace('|', '/')} | "
                  f"**{c.verdict_text()}** | {_design_text(c)} | {c.rule_error} | "
                  f"{_ladder_text(rep, c.key)} |")
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
        h += [f"<figure>{svgs[name]}<figcaption>{escape(caption)}</figcaption></figure>"
              for name, caption in rep.figures if name in svgs]
        h += ["<h2>Cells at a glance</h2>",
              f"<p>{escape(GLANCE_NOTE)}</p>", html_table(glance_rows(rep.glance)),
              "<h2>Seed stability</h2>", f"<p>{escape(SEEDS_NOTE)}</p>",
              html_table(seed_rows([cv for cv, _ in rep.cells], rep.glance))]
        for cv, sub in rep.cells:
            h += [f"<h2>Cell {escape(cv.label)}</h2>",
                  "<p>" + escape(sub.design_text).replace("**", "") + "</p>",
                  html_table(sub.design)]
            h += _html_claims(sub, 3, f"{_slug(cv.label)}-", svgs)
    return page(f"qkgeom report: {_heading(rep)}", "\n".join(h), body_class="doc")


def _html_claims(rep: Report, level: int, fig: str, svgs: dict[str, str]) -> list[str]:
    hn, hs = f"h{level}", f"h{level + 1}"
    h = [f"<{hn}>Claims and verdicts</{hn}><p>{escape(rep.calibration)}</p>"
         "<table><thead><tr><th>claim</th><th>paper</th>"
         "<th>measured</th><th>verdict</th><th>at this design</th>"
         "<th>the rule's calibration</th>"
         f"<th>{escape(_ladder_head(rep))}</th></tr></thead><tbody>"]
    for c in rep.claims:
        h.append(f"<tr><td>{escape(c.key)}</td><td>{escape(c.paper)}</td>"
                 f"<td>{escape(c.measured)}</td>"
                 + verdict_cell(c.verdict, escape(c.verdict_text()[len(c.verdict):]))
                 + f"<td>{escape(_design_text(c))}</td><td>{escape(c.rule_error)}</td>"
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
        data["glance"] = rep.glance
    return json.dumps(to_jsonable(data), indent=2, allow_nan=False)


# --------------------------------------------------------------------------- files


def _slug(label: str) -> str:
    """A cell label as part of a file name (``ladder/e48`` -> ``ladder_e48``)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", label)


def write_report(rep: Report, out: Path) -> list[Path]:
    """Write the figures (PNG for markdown, SVG inline for HTML) and the three renderings
    into the directory ``out``; the paths written, sorted."""
    from qkgeom.report import plots

    svgs: dict[str, str] = {}
    written: list[Path] = []
    charts = dict(rep.charts)
    for cv, sub in rep.cells:
        charts.update({f"{_slug(cv.label)}-{name}": chart for name, chart in sub.charts.items()})
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


def build_report(store: Store, sweep: str | A.Scope, out_dir: str | Path, *,
                 compare: Sequence[str | A.Scope] = (), ladder: Sequence[str | A.Scope] = (),
                 seed: int = 0, n_boot: int = 10_000, finished_only: bool = True) -> list[Path]:
    """Compute every claim's verdict for ``sweep`` (with the ``compare`` sweeps as further
    cells, and the ``ladder`` sweeps' column; :func:`compute_report`) and write the report
    into ``out_dir``."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise QkgeomError(f"--out {out} is a file; give a directory for the report")
    out.mkdir(parents=True, exist_ok=True)
    rep = compute_report(store, sweep, compare=compare, ladder=ladder, seed=seed, n_boot=n_boot,
                         finished_only=finished_only)
    return write_report(rep, out)
