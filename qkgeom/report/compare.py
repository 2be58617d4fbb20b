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
from qkgeom.report.claims import compute_claims, grid_verdicts
from qkgeom.report.sensitivity import CellVerdicts, Factor, across_cells, study_factors

if TYPE_CHECKING:
    from qkgeom.store import Store

# the verdict rules the report's verdicts follow: 1 = before the calibration of issue 25,
# 2 = the calibrated rules (docs/statistics.md, "Calibration"); written into report.json
RULES_VERSION = 2
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
                 finished_only: bool = True) -> tuple[list[Factor], list[CellVerdicts]]:
    """Every claim decided on each cell alone (no figures, no tables): the factors and
    the cells' verdicts."""
    factors, values = part_factors(store, parts)
    out = []
    for label, scope in parts:
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
