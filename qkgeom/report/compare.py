"""The cells of a comparison, read from the database: sweeps, and the cells inside them.

A report decides every claim on one cell's trials at a time. The cells of a report are
the cells of its sweep (a spec with ``cells`` or ``axes``), or, given several sweeps
(``qkgeom report --compare``), each sweep (each of its cells when it has several). A
single-cell report can also be set beside a *ladder* (``qkgeom report --ladder``): other
sweeps, typically the scale x learning-rate ladder of docs/findings.md
(``studies/ladder.yaml``), whose cells are decided here, under the rules of this qkgeom, so
that the column 'on the ladder' says whether the ladder saw each claim's verdict move with
width, learning rate or any other factor. Nothing is read from a file of past verdicts:
changed rules change the column the next time a report is written.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from qkgeom import analysis as A
from qkgeom.analysis.cells import cell_facts, grid_seeds
from qkgeom.errors import QkgeomError
from qkgeom.report.claims import (
    CONTRADICTED,
    HOLDS,
    NO_DATA,
    NOT_SHOWN,
    compute_claims,
    grid_verdicts,
)
from qkgeom.report.sensitivity import CellVerdicts, Factor, across_cells, study_factors

if TYPE_CHECKING:
    from qkgeom.store import Store

# the verdict rules the report's verdicts follow: 1 = before the calibration of issue 25,
# 2 = the calibrated rules (docs/statistics.md, "Calibration"), 3 = the rules of issue 41
# (claim 2 over seeds, claim 5 against dependent nulls), 4 = claim 3 at matched training
# progress and the verdict words holds / not shown / contradicted; written into report.json
RULES_VERSION = 4
FINDINGS = "docs/findings.md"

Part = tuple[str, A.Scope]  # (cell label, the trials it reads)


def as_scope(sweep: str | A.Scope) -> A.Scope:
    return sweep if isinstance(sweep, A.Scope) else A.Scope(sweep)


def comparison_parts(store: Store, sweeps: Sequence[str | A.Scope]) -> list[Part]:
    """The cells of a comparison of ``sweeps``: one per sweep, or one per cell of a sweep
    with several. Labels are the cell labels for one sweep, else the sweep names (with
    ``/cell`` for a sweep's cells)."""
    scopes = [as_scope(s) for s in sweeps]
    names = [s.name for s in scopes]
    if len(set(names)) < len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise QkgeomError(f"sweep {twice!r} is named twice in the comparison; name each "
                          "sweep once")
    parts: list[Part] = []
    for scope in scopes:
        cells = A.cells_of(store, scope)
        if len(cells) > 1:
            parts += [(c if len(scopes) == 1 else f"{scope.name}/{c}", scope.narrow(cell=c))
                      for c in cells]
        else:
            parts.append((cells[0] if cells and len(scopes) == 1 else scope.name, scope))
    return parts


def part_factors(store: Store, parts: Sequence[Part]) -> tuple[list[Factor],
                                                                dict[str, dict[str, Any]]]:
    """The factors the cells differ in (config keys), and each cell's values."""
    configs = {label: [r["config"] for r in A.trial_rows(store, scope) if scope.keep(r)]
               for label, scope in parts}
    return study_factors(configs)


def decide_cells(store: Store, parts: Sequence[Part], *, seed: int = 0, n_boot: int = 10_000,
                 finished_only: bool = True, decided: dict[str, dict[str, str]] | None = None
                 ) -> tuple[list[Factor], list[CellVerdicts]]:
    """Every claim decided on each cell alone (no figures, no tables): the factors and
    the cells' verdicts. ``decided``: cell label -> verdicts already computed (not redone)."""
    factors, values = part_factors(store, parts)
    out = []
    for label, scope in parts:
        if decided and label in decided:
            out.append(CellVerdicts(label, values[label], decided[label]))
            continue
        found = compute_claims(store, scope, seed=seed, n_boot=n_boot,
                               finished_only=finished_only)
        out.append(CellVerdicts(label, values[label], {c.key: c.verdict for c in found.claims}))
    return factors, out


def column(verdicts: Sequence[CellVerdicts], factors: Sequence[Factor],
           keys: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Claim key -> how its verdict fares over the cells: a one-line ``summary``
    (:func:`qkgeom.report.sensitivity.across_cells`) and each cell's verdict."""
    return {k: {"summary": across_cells(verdicts, k, factors),
                "cells": {v.label: v.verdicts.get(k) for v in verdicts}} for k in keys}


def seed_stability(store: Store, scope: A.Scope, *, seed: int = 0,
                   finished_only: bool = True) -> dict[int, dict[str, str]]:
    """Grid seed -> the grid claims' verdicts on that seed's trials alone (a filter, not a
    copy of the database): whether a cell's verdict rests on every seed or on one."""
    t = A.sweep_trials(store, scope)
    if finished_only:
        t = t.filter(t["status"] == "terminated")
    out = {}
    for s in grid_seeds(t):
        one = A.Scope(scope.name, scope.where, (s,))
        out[s] = grid_verdicts(store, one, seed=seed, finished_only=finished_only)
    return out


def glance(store: Store, parts: Sequence[Part], *, seed: int = 0,
           finished_only: bool = True) -> dict[str, dict[str, Any]]:
    """Cell label -> its facts (:func:`qkgeom.analysis.cells.cell_facts`) and ``per_seed``
    (:func:`seed_stability`)."""
    return {label: {**cell_facts(store, scope, finished_only=finished_only),
                    "per_seed": seed_stability(store, scope, seed=seed,
                                               finished_only=finished_only)}
            for label, scope in parts}


# ------------------------------------------------------------------ the comparison's tables

ARMS_SHOWN = ("none", "hold", "shrink", "shrink_act")
SHORT = {HOLDS: "holds", NOT_SHOWN: "no", CONTRADICTED: "contra", NO_DATA: "?"}


def _duration(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min" if s >= 3600 else \
        f"{int(s // 60)} min {int(s % 60):02d} s"


def glance_rows(facts: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per cell of :func:`glance`'s facts: trials, time, mean test loss per arm,
    claim 2's gap at the last probe per grid seed, the last layer's PR_Q / PR_K per depth."""
    rows = []
    for label, g in facts.items():
        tl = g["test_loss"]
        rows.append({
            "cell": label, "trials (terminated)": f"{g['trials']} ({g['terminated']})",
            "trial time (sum)": _duration(g["trial_s"]), "first start to last end":
                _duration(g["span_s"]),
            "mean test loss (" + " / ".join(ARMS_SHOWN) + ")": " / ".join(
                A.fmt(tl[a], 3) if tl.get(a) is not None else "-" for a in ARMS_SHOWN),
            "PR_Q > PR_K at the last probe, (trial, layer) units per seed": ", ".join(
                f"seed {s}: {a}/{n}" for s, (a, n) in g["gap_per_seed"].items()) or "-",
            "last layer, mean PR_Q / PR_K (PR_Q > PR_K in k of n runs)": "; ".join(
                f"d{d}: {v['pr_q']:.2f} / {v['pr_k']:.2f} ({v['q_gt_k']}/{v['n']})"
                for d, v in g["last_layer"].items()) or "-"})
    return rows


def seed_rows(cells: Sequence[CellVerdicts], facts: dict[str, dict[str, Any]]
              ) -> list[dict[str, Any]]:
    """One row per cell: each grid claim decided on every grid seed alone, then on all
    the cell's seeds (its verdict)."""
    rows = []
    for cv in cells:
        per = facts.get(cv.label, {}).get("per_seed", {})
        keys = list(dict.fromkeys(k for v in per.values() for k in v))
        head = " / ".join([*(f"seed {s}" for s in per), "all"])
        rows.append({"cell": cv.label, **{
            f"{k}: {head}": " / ".join(SHORT.get(v.get(k, NO_DATA), "?") for v in
                                       [*per.values(), cv.verdicts]) for k in keys}})
    return rows


GLANCE_NOTE = ("Trial time sums each terminated trial's start to end (its last attempt); "
               "the span includes pauses between resumed runs. The gap counts (trial, "
               "layer) units of the grid seeds' baseline trials at the last probe.")
SEEDS_NOTE = ("The grid claims decided on each grid seed's trials alone (a filter on the "
              "stored trials), then on all seeds: 'holds', 'no' (not shown), 'contra' (contradicted), '?' (not "
              "enough data). A verdict that holds only with every seed pooled rests on the "
              "pooling.")


FINAL_GAP_CAPTION = ("PR_Q - PR_K at the last probe per layer, one panel per cell, rows = "
                     "depth, mean over the grid seeds' baseline runs (claim 2 across cells)")


def cells_chart(store: Store, parts: Sequence[tuple[str, A.Scope]],
                 fin: bool) -> dict[str, Any]:
    """The comparison's own figure: claim 2's final gap per layer, faceted by cell."""
    import polars as pl

    from qkgeom.report import plots

    frames = []
    for label, scope in parts:
        try:
            units = A.pr_gap_units(store, scope, level="run", finished_only=fin)
        except QkgeomError:
            continue
        final = A.summarise_gap(units, summary="final", level="run")
        frames.append(final.select("depth", "init", "layer", "value")
                      .with_columns(pl.lit(label).alias("cell")))
    if not frames:
        return {}
    return {"final-gap": plots.final_gap(pl.concat(frames), facet="cell")}
