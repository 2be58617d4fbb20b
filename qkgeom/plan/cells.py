"""A spec's cells: the factors a study varies beyond depth x init x seed.

A *factor* is a :class:`~qkgeom.config.TrialConfig` key given several values. The spec
names them in one of two ways, or both (then every named cell is crossed with the axes)::

    axes:                      # a full product; cell labels are built from the values
      n_head: [2, 4]
      lr: [1.0e-3, 3.0e-3]     # -> cells n_head2-lr0.001, n_head2-lr0.003, ...
    cells:                     # named cells, for designs that are not a product
      e32-lr1e-3: {n_embd: 32, block_size: 32, lr: 1.0e-3, min_lr: 1.0e-4}
      e48-lr1e-3: {n_embd: 48, block_size: 48, lr: 1.0e-3, min_lr: 1.0e-4}

Each cell runs the spec's whole grid and intervention study with its factor values on
top of ``trial.overrides``; its trial keys start with the cell label
(``e48-lr1e-3.d2-gaussian-none-s0``), so arms pair with the baseline of their own cell.
A spec without ``axes`` and ``cells`` is one unnamed cell and keeps the plain keys.
"""

from __future__ import annotations

import difflib
import itertools
import re
from dataclasses import dataclass, field
from typing import Any

from qkgeom.config import ConfigError, TrialConfig

# set per trial by the grid and the arms: a factor over them would be lost
PER_TRIAL_KEYS = ("n_layer", "init", "arm", "seed")
LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class Cell:
    """One cell of a study: its label (None for a spec without factors) and values."""

    label: str | None
    factors: dict[str, Any] = field(default_factory=dict)


def _check_factor(name: Any, where: str) -> None:
    names = TrialConfig.field_names()
    if name in PER_TRIAL_KEYS:
        raise ConfigError(f"{where}.{name}: set per trial by the sweep; use grid.depths, "
                          "grid.inits, interventions.arms or the seeds lists instead")
    if name not in names:
        near = difflib.get_close_matches(str(name), names, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ConfigError(f"{where}: unknown factor {name!r}{hint}; a factor is a "
                          "TrialConfig key (qkgeom train --help lists them)")


def value_label(value: Any) -> str:
    """The short text of a factor value in a cell label: ``0.001``, ``4``, ``true``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _axes(axes: Any) -> list[Cell]:
    if not isinstance(axes, dict) or not axes:
        raise ConfigError("axes: expected a mapping factor -> list of values")
    names = list(axes)
    for name in names:
        _check_factor(name, "axes")
        values = axes[name]
        if not isinstance(values, list) or not values:
            raise ConfigError(f"axes.{name}: expected a non-empty list of values, "
                              f"got {values!r}")
        if len({repr(v) for v in values}) != len(values):
            raise ConfigError(f"axes.{name}: duplicate values in {values}")
    cells = []
    for combo in itertools.product(*(axes[n] for n in names)):
        label = "-".join(f"{n}{value_label(v)}" for n, v in zip(names, combo))
        if not LABEL.match(label):
            raise ConfigError(f"axes: the cell label {label!r} has characters other than "
                              "letters, digits, '.', '_' and '-'; name the cells instead "
                              "(a 'cells' section)")
        cells.append(Cell(label, dict(zip(names, combo))))
    return cells


def _named(cells: Any) -> list[Cell]:
    if not isinstance(cells, dict) or not cells:
        raise ConfigError("cells: expected a mapping cell name -> {factor: value}")
    out = []
    for label, values in cells.items():
        if not isinstance(label, str) or not LABEL.match(label):
            raise ConfigError(f"cells: the name {label!r} must be letters, digits, '.', "
                              "'_' or '-' (it starts every trial key of the cell)")
        if not isinstance(values, dict) or not values:
            raise ConfigError(f"cells.{label}: expected a mapping factor -> value")
        for name in values:
            _check_factor(name, f"cells.{label}")
        out.append(Cell(label, dict(values)))
    return out


def spec_cells(spec: dict[str, Any], overrides: dict[str, Any]) -> list[Cell]:
    """The cells of a raw spec (its ``axes`` and ``cells`` sections), validated: factor
    names are TrialConfig keys not set per trial and not also in ``trial.overrides``."""
    axes, named = spec.get("axes"), spec.get("cells")
    if axes is None and named is None:
        return [Cell(None)]
    first = _named(named) if named is not None else [Cell(None)]
    second = _axes(axes) if axes is not None else [Cell(None)]
    out = []
    for a, b in itertools.product(first, second):
        both = sorted(set(a.factors) & set(b.factors))
        if both:
            raise ConfigError(f"{', '.join(both)}: both an axis and a value of cell "
                              f"{a.label!r}; give each factor in one place")
        out.append(Cell("-".join(x for x in (a.label, b.label) if x),
                        {**a.factors, **b.factors}))
    fixed = sorted({k for c in out for k in c.factors} & set(overrides))
    if fixed:
        raise ConfigError(f"trial.overrides.{fixed[0]}: also a factor of the cells; "
                          "remove it from trial.overrides (each cell sets it)")
    return out


def factor_names(cells: list[Cell]) -> list[str]:
    """Every factor of the cells, in first-seen order."""
    seen: dict[str, None] = {}
    for c in cells:
        seen.update(dict.fromkeys(c.factors))
    return list(seen)
