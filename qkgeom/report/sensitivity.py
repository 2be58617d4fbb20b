"""Which factors a claim's verdict depends on, from verdicts decided cell by cell.

A study with cells (qkgeom.plan.cells) varies factors beyond the geometry grid: width,
learning rate, heads. Each cell's claims are decided on that cell's trials alone; this
module compares them. For a claim and a factor, the cells are grouped by the values of
every *other* factor; within a group only this factor changes, so a group whose decided
verdicts differ shows the verdict flipping with this factor at those fixed others.

Factors are read from the trials' stored configs: a config key whose value differs
between cells. Keys that change together in every cell (``n_embd`` with ``block_size``,
``lr`` with ``min_lr``) cannot be told apart by the design and count as one factor, named
after the first in :data:`qkgeom.analysis.SCALE_KEYS` order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from qkgeom.stats.rules import DECIDED, HOLDS


@dataclass(frozen=True)
class Factor:
    """A factor of a study's cells: its name and the keys that always change with it."""

    name: str
    partners: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return self.name + (f" (with {', '.join(self.partners)})" if self.partners else "")


@dataclass
class CellVerdicts:
    """One cell: its label, its factor values and the verdict of each claim."""

    label: str
    factors: dict[str, Any]
    verdicts: dict[str, str] = field(default_factory=dict)


def _order(key: str) -> tuple[int, str]:
    from qkgeom.analysis import SCALE_KEYS

    names = [k for k, _ in SCALE_KEYS]
    return (names.index(key) if key in names else len(names), key)


def _text(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def study_factors(configs: dict[str, list[dict[str, Any]]]) -> tuple[list[Factor],
                                                                   dict[str, dict[str, Any]]]:
    """The factors of cells given each cell's trial configs, and each cell's values.

    A key is a factor when its value differs between cells (a key that also varies
    within a cell, like ``seed``, is not). Keys whose values determine each other across
    the cells are merged into one factor."""
    per_cell: dict[str, dict[str, Any]] = {}
    keys = sorted({k for cfgs in configs.values() for c in cfgs for k in c}, key=_order)
    for cell, cfgs in configs.items():
        per_cell[cell] = {}
        for k in keys:
            vals = {repr(c.get(k)) for c in cfgs}
            if len(vals) == 1:
                per_cell[cell][k] = cfgs[0].get(k) if cfgs else None
    varying = [k for k in keys
               if all(k in v for v in per_cell.values())
               and len({repr(v[k]) for v in per_cell.values()}) > 1]
    factors: list[Factor] = []
    taken: set[str] = set()
    for k in varying:
        if k in taken:
            continue
        sig = _partition(per_cell, k)
        partners = tuple(j for j in varying if j != k and j not in taken
                         and _partition(per_cell, j) == sig)
        taken.update((k, *partners))
        factors.append(Factor(k, partners))
    values = {cell: {f.name: v[f.name] for f in factors} for cell, v in per_cell.items()}
    return factors, values


def _partition(per_cell: dict[str, dict[str, Any]], key: str) -> frozenset[frozenset[str]]:
    """The cells grouped by their value of ``key`` (equal partitions = keys that change
    together)."""
    groups: dict[str, set[str]] = {}
    for cell, v in per_cell.items():
        groups.setdefault(repr(v[key]), set()).add(cell)
    return frozenset(frozenset(g) for g in groups.values())


def flips(cells: Sequence[CellVerdicts], claim: str, factor: str,
          factors: Sequence[str]) -> tuple[int, list[str]]:
    """(comparisons, fixed settings where it flips) for ``claim`` along ``factor``: a
    comparison is a group of at least two cells with a decided verdict that differ only
    in ``factor``; it flips where their verdicts differ."""
    others = [f for f in factors if f != factor]
    groups: dict[tuple[str, ...], set[str]] = {}
    sizes: dict[tuple[str, ...], int] = {}
    for c in cells:
        v = c.verdicts.get(claim)
        if v not in DECIDED:
            continue
        key = tuple(f"{o}={_text(c.factors.get(o))}" for o in others)
        groups.setdefault(key, set()).add(v)
        sizes[key] = sizes.get(key, 0) + 1
    compared = [k for k in groups if sizes[k] >= 2]
    flipped = sorted(", ".join(k) or "all cells" for k in compared if len(groups[k]) > 1)
    return len(compared), flipped


def changes(cells: Sequence[CellVerdicts], claim: str, factor: str,
            factors: Sequence[str]) -> list[str]:
    """Where ``claim``'s verdict changes along ``factor``: between neighbouring values of
    the factor (in numeric order, among cells with a decided verdict) at fixed other
    factors, e.g. ``64 -> 128: not shown -> holds, at lr=0.001``."""
    from qkgeom.analysis.scope import value_order

    others = [f for f in factors if f != factor]
    lines: dict[tuple[str, ...], list[tuple[Any, str]]] = {}
    for c in cells:
        v = c.verdicts.get(claim)
        if v in DECIDED:
            key = tuple(f"{o}={_text(c.factors.get(o))}" for o in others)
            lines.setdefault(key, []).append((c.factors.get(factor), v))
    out = []
    for key in sorted(lines):
        pts = sorted(lines[key], key=lambda p: value_order(_text(p[0])))
        at = f", at {', '.join(key)}" if key else ""
        out += [f"{_text(a)} -> {_text(b)}: {va} -> {vb}{at}"
                for (a, va), (b, vb) in zip(pts, pts[1:]) if va != vb]
    return out


def sensitivity_table(cells: Sequence[CellVerdicts], claims: Sequence[str],
                      factors: Sequence[Factor]) -> list[dict[str, Any]]:
    """claim x factor: ``flips (at ...)``, ``stable (n comparisons)`` or ``not compared``
    (no two cells with a decided verdict differ in this factor alone)."""
    names = [f.name for f in factors]
    rows = []
    for claim in claims:
        decided = [c for c in cells if c.verdicts.get(claim) in DECIDED]
        row: dict[str, Any] = {"claim": claim,
                               "decided cells": f"{len(decided)} of {len(cells)}"}
        for f in factors:
            n, at = flips(cells, claim, f.name, names)
            if at:
                row[f.label] = "flips" + ("" if at == ["all cells"] else
                                          f" (at {'; '.join(at)})")
            else:
                row[f.label] = f"stable ({n} comparison{'s' if n != 1 else ''})" if n \
                    else "not compared"
        rows.append(row)
    return rows


def across_cells(cells: Sequence[CellVerdicts], claim: str,
                 factors: Sequence[Factor]) -> str:
    """One line for a claim over the cells: the verdict counts and what flips it."""
    decided = [c.verdicts[claim] for c in cells if c.verdicts.get(claim) in DECIDED]
    n_h = decided.count(HOLDS)
    parts = [f"holds in {n_h} of {len(cells)} cells"
             + (f", {len(cells) - len(decided)} undecided" if len(decided) < len(cells)
                else "")]
    names = [f.name for f in factors]
    moved = [f.name for f in factors if flips(cells, claim, f.name, names)[1]]
    if moved:
        parts.append("flips with " + " and ".join(
            f"{m} ({'; '.join(changes(cells, claim, m, names))})" for m in moved))
    elif len(set(decided)) == 1 and len(decided) > 1:
        parts.append("the same in every decided cell")
    return "; ".join(parts)
