"""Which trials of a sweep a statistic reads: the sweep, and optionally a filter on factor
values (``--where n_embd=48``, ``--where cell=e48-lr1e-3``) and seeds (``--seeds 0,1``).

A :class:`Scope` is accepted wherever the analysis takes a sweep name; a plain name is the
whole sweep. Filters select trials, they never change stored rows, so per-seed or per-cell
verdicts need no copies of the database. A factor is a trial column (``cell``, ``depth``,
``init``, ``arm``, ``seed``) or any key of the trials' stored config (``n_embd``, ``lr``,
``n_head`` ...); values are compared as numbers where both sides are numbers
(``lr=1e-3`` matches a stored 0.001), else as text.

``config.KEY`` always names the config key and ``trial.COLUMN`` the trial column. A plain
name that is both (a config key ``status`` beside the trial's status) is refused when the
two differ for some trial, with both spellings to choose from; where they agree (``seed``,
``init``, ``arm``: the sweep sets both) the plain name is the trial column.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from qkgeom.analysis.common import AnalysisError

# trial columns a filter may name (n_layer is the config's name of depth)
COLUMNS = ("cell", "depth", "init", "arm", "seed", "status")


@dataclass(frozen=True)
class Scope:
    """A sweep, narrowed to the trials whose factors take the given values."""

    name: str
    where: tuple[tuple[str, tuple[str, ...]], ...] = ()
    seeds: tuple[int, ...] | None = None

    @property
    def filtered(self) -> bool:
        return bool(self.where) or self.seeds is not None

    def describe(self) -> str:
        """The filter in words (``n_embd=48; seeds 0,1``), empty for the whole sweep."""
        parts = [f"{k}={','.join(v)}" for k, v in self.where]
        if self.seeds is not None:
            parts.append("seeds " + ",".join(map(str, self.seeds)))
        return "; ".join(parts)

    def __str__(self) -> str:
        return f"{self.name} [{self.describe()}]" if self.filtered else self.name

    def __repr__(self) -> str:
        return repr(str(self))

    def to_dict(self) -> dict[str, Any]:
        return {"where": {k: list(v) for k, v in self.where},
                "seeds": None if self.seeds is None else list(self.seeds)}

    def narrow(self, **where: Any) -> Scope:
        """This scope with more conditions (``narrow(cell="e48")``)."""
        extra = tuple((k, (str(v),)) for k, v in where.items())
        return Scope(self.name, self.where + extra, self.seeds)

    def keep(self, row: dict[str, Any]) -> bool:
        """Whether a trial row (analysis.trials.trial_rows) is in the scope."""
        if self.seeds is not None and row["seed"] not in self.seeds:
            return False
        return all(any(same(factor_value(row, k), v) for v in vals) for k, vals in self.where)


def sweep_name(sweep: str | Scope) -> str:
    """The sweep's name, for a name or a scope."""
    return sweep.name if isinstance(sweep, Scope) else sweep


def scope_fields(sweep: str | Scope) -> dict[str, Any]:
    """The sweep's name for a JSON result, with the filter when there is one."""
    if isinstance(sweep, Scope) and sweep.filtered:
        return {"sweep": sweep.name, **sweep.to_dict()}
    return {"sweep": sweep_name(sweep)}


_MISSING = object()
CONFIG, TRIAL = "config.", "trial."


def factor_value(row: dict[str, Any], name: str) -> Any:
    """A trial's value of factor ``name``: a trial column or a config key, ``config.KEY``
    (always the config key) or ``trial.COLUMN`` (always the trial column)."""
    if name.startswith(CONFIG):
        return row["config"].get(name[len(CONFIG):], _MISSING)
    if name.startswith(TRIAL):
        name = name[len(TRIAL):]
        if name not in (*COLUMNS, "n_layer"):
            return _MISSING
    if name == "n_layer":
        return row["depth"]
    if name in COLUMNS:
        return row.get(name)
    return row["config"].get(name, _MISSING)


def same(stored: Any, given: str) -> bool:
    """Whether a stored value equals a value typed on the command line."""
    if stored is _MISSING or stored is None:
        return given.lower() in ("none", "null", "") and stored is None
    if isinstance(stored, bool):
        return given.lower() in (("true", "1", "yes") if stored else ("false", "0", "no"))
    if isinstance(stored, (int, float)):
        try:
            g = float(given)
        except ValueError:
            return False
        return math.isclose(float(stored), g, rel_tol=1e-9, abs_tol=0.0)
    return str(stored) == given


def parse_where(items: Iterable[str]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``["n_embd=48", "lr=1e-3,3e-3"]`` -> ``(("n_embd", ("48",)), ("lr", ("1e-3", "3e-3")))``."""
    out = []
    for item in items:
        name, eq, values = item.partition("=")
        name = name.strip()
        vals = tuple(v.strip() for v in values.split(",") if v.strip())
        if not eq or not name or not vals:
            raise AnalysisError(f"--where {item!r}: expected FACTOR=VALUE[,VALUE...], e.g. "
                                "--where n_embd=48 or --where lr=0.001,0.003")
        out.append((name, vals))
    return tuple(out)


def parse_seeds(text: str | None) -> tuple[int, ...] | None:
    """``"0,1"`` -> ``(0, 1)``; None stays None."""
    if text is None:
        return None
    try:
        seeds = tuple(sorted({int(s) for s in text.split(",") if s.strip()}))
    except ValueError:
        raise AnalysisError(f"--seeds {text!r}: expected integers separated by commas, "
                            "e.g. --seeds 0,1") from None
    if not seeds:
        raise AnalysisError("--seeds: give at least one seed, e.g. --seeds 0,1")
    return seeds


def _show(v: Any) -> str:
    return "(unset)" if v is _MISSING else str(v)


def check_scope(scope: Scope, rows: Sequence[dict[str, Any]]) -> None:
    """Refuse, in one line, a filter naming a factor the sweep's trials do not have, a
    value no trial takes, a seed no trial has, or one that leaves no trial."""
    keys = {k for r in rows for k in r["config"]}
    names = sorted(set(COLUMNS) | {"n_layer"} | keys)
    for key, vals in scope.where:
        if key.startswith(CONFIG) and key[len(CONFIG):] not in keys:
            k = key[len(CONFIG):]
            near = difflib.get_close_matches(k, sorted(keys), n=1)
            hint = f" (did you mean {CONFIG}{near[0]}?)" if near else ""
            raise AnalysisError(f"--where {key}=...: the trials of sweep {scope.name!r} have "
                                f"no config key {k!r}{hint}; config keys: "
                                f"{', '.join(sorted(keys)) or '(none)'}")
        if key.startswith(TRIAL) and key[len(TRIAL):] not in (*COLUMNS, "n_layer"):
            raise AnalysisError(f"--where {key}=...: no trial column "
                                f"{key[len(TRIAL):]!r}; trial columns: "
                                f"{', '.join((*COLUMNS, 'n_layer'))}")
        if key in COLUMNS and key in keys:
            _refuse_ambiguous(scope, key, vals, rows)
        if key not in names and not key.startswith((CONFIG, TRIAL)):
            near = difflib.get_close_matches(key, names, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise AnalysisError(f"--where {key}=...: sweep {scope.name!r} has no factor "
                                f"{key!r}{hint}; factors: {', '.join(names)}")
        present = {_show(factor_value(r, key)) for r in rows}
        for v in vals:
            if not any(same(factor_value(r, key), v) for r in rows):
                raise AnalysisError(
                    f"--where {key}={v}: no trial of sweep {scope.name!r} has that value; "
                    f"values present: {', '.join(sorted(present, key=value_order))}")
    if scope.seeds is not None:
        have = sorted({r["seed"] for r in rows})
        missing = [s for s in scope.seeds if s not in have]
        if missing:
            raise AnalysisError(f"--seeds: sweep {scope.name!r} has no seed "
                                f"{', '.join(map(str, missing))}; seeds present: "
                                f"{', '.join(map(str, have))}")
    if not any(scope.keep(r) for r in rows):
        raise AnalysisError(f"no trial of sweep {scope.name!r} matches {scope.describe()}; "
                            "each condition alone matches some, together none")


def _refuse_ambiguous(scope: Scope, key: str, vals: tuple[str, ...],
                      rows: Sequence[dict[str, Any]]) -> None:
    """Refuse ``key`` when it is both a trial column and a config key whose value differs
    from the column's for some trial (the two spellings name different things)."""
    differs = [r for r in rows if key in r["config"] and not same(r.get(key),
                                                                   _show(r["config"][key]))]
    if not differs:
        return
    col = sorted({_show(r.get(key)) for r in rows}, key=value_order)
    cfg = sorted({_show(factor_value(r, CONFIG + key)) for r in rows}, key=value_order)
    v = ",".join(vals)
    raise AnalysisError(
        f"--where {key}={v}: {key!r} is both the trial column {key!r} (values: "
        f"{', '.join(col)}) and a config key of the trials of sweep {scope.name!r} (values: "
        f"{', '.join(cfg)}); write --where config.{key}={v} for the config key or --where "
        f"trial.{key}={v} for the trial column")


def value_order(text: str) -> tuple[int, float, str]:
    """Sort key of values typed or shown as text: numbers by value first, then text."""
    try:
        return (0, float(text), text)
    except ValueError:
        return (1, 0.0, text)
