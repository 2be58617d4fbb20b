"""The sweep's trials: which sweep, which metrics exist, which trials a statistic uses, and
what the study ran (its scale and the arms' seeds)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import polars as pl

from qkgeom.analysis.common import BASELINE_ARM, AnalysisError
from qkgeom.analysis.scope import Scope, check_scope, parse_seeds, parse_where, sweep_name
from qkgeom.records import METRICS
from qkgeom.store.queries import metric_definition_names

if TYPE_CHECKING:
    from qkgeom.store import Store


def resolve_sweep(store: Store, sweep: str | None) -> str:
    """The sweep to analyse: ``sweep`` if it exists, else the only one in the database."""
    names = store.sweep_names()
    if sweep is None:
        if len(names) == 1:
            return names[0]
        if not names:
            raise AnalysisError("the database holds no sweeps yet; run one with "
                                "`qkgeom sweep` (or point --db at another database)")
        raise AnalysisError(f"the database holds {len(names)} sweeps; pick one with --sweep "
                            f"NAME: {', '.join(names)}")
    if sweep not in names:
        have = ", ".join(names) if names else "(none)"
        raise AnalysisError(f"no sweep named {sweep!r} in the database; existing sweeps: {have}")
    return sweep


def known_metrics(store: Store) -> list[str]:
    """Metric names this qkgeom defines plus those the database declares or holds."""
    names = set(METRICS)
    try:
        names |= set(metric_definition_names(store))
    except Exception:  # an older schema without the table: the record contract suffices
        pass
    return sorted(names)


def check_metric(store: Store, name: str) -> str:
    if name in METRICS:
        return name
    valid = known_metrics(store)
    if name not in valid:
        raise AnalysisError(f"unknown metric {name!r}; valid metrics: {', '.join(valid)}")
    return name


def _parsed(c: Any) -> dict[str, Any]:
    return json.loads(c) if isinstance(c, str) else (c or {})


def _in_scope(store: Store, sweep: str | Scope) -> pl.DataFrame:
    """:meth:`Store.trials` of the sweep, narrowed to the scope's trials."""
    t = store.trials(sweep_name(sweep))
    if isinstance(sweep, Scope) and sweep.filtered and t.height:
        rows = t.select("depth", "init", "arm", "seed", "status", "cell",
                        "config").to_dicts()
        keep = [sweep.keep({**r, "config": _parsed(r["config"])}) for r in rows]
        t = t.filter(pl.Series(keep, dtype=pl.Boolean))
    return t


def sweep_trials(store: Store, sweep: str | Scope, *more: str) -> pl.DataFrame:
    """One row per trial of ``sweep`` (a name, or a :class:`~qkgeom.analysis.scope.Scope`
    that narrows it; :meth:`Store.trials`, ordered by id): trial_id, depth, init, arm,
    seed, status, then the columns ``more`` of :meth:`Store.trials`."""
    return _in_scope(store, sweep).select(pl.col("id").alias("trial_id"), "depth", "init",
                                          "arm", "seed", "status", *more)


def trial_rows(store: Store, sweep: str | Scope) -> list[dict[str, Any]]:
    """Every trial of ``sweep`` as a dict: trial_id, depth, init, arm, seed, status,
    test_loss (None until finished), cell and config (parsed)."""
    rows = sweep_trials(store, sweep, "test_loss", "cell", "config").to_dicts()
    for r in rows:
        r["config"] = _parsed(r["config"])
        tl = r["test_loss"]
        r["test_loss"] = None if tl is None or (isinstance(tl, float) and math.isnan(tl)) \
            else float(tl)
    return rows


def resolve_scope(store: Store, sweep: str | None, where: tuple[str, ...] | list[str] = (),
                  seeds: str | None = None) -> Scope:
    """The trials to analyse: the sweep (:func:`resolve_sweep`) narrowed by ``--where``
    conditions and ``--seeds``, each checked against the sweep's trials (one-line errors
    for an unknown factor, a value or seed no trial has, or an empty selection)."""
    scope = Scope(resolve_sweep(store, sweep), parse_where(where), parse_seeds(seeds))
    if scope.filtered:
        check_scope(scope, trial_rows(store, scope.name))
    return scope


def cells_of(store: Store, sweep: str | Scope) -> list[str]:
    """The distinct cell labels of the scope's trials (empty for a sweep without cells)."""
    t = _in_scope(store, sweep)
    return sorted({c for c in t["cell"].to_list() if c is not None})


# (config key, label) of what the report states about a study's scale and optimiser
SCALE_KEYS = [("n_embd", "width n_embd"), ("n_head", "heads"), ("block_size", "context"),
              ("max_steps", "training steps"), ("batch_size", "batch (sequences)"),
              ("lr", "peak lr"), ("min_lr", "lr floor (cosine)"), ("warmup", "warm-up steps"),
              ("weight_decay", "weight decay"), ("betas", "AdamW betas")]


def grid_seed_list(points: Iterable[tuple[int, int, str]]) -> list[int]:
    """Seeds of the geometry grid among arm-``none`` trials given as (seed, depth, init):
    those present in every (depth, init) of that arm (the extra baselines of the arms, at
    one (depth, init) only, are not)."""
    by_seed: dict[int, set[tuple[int, str]]] = {}
    for seed, depth, init in points:
        by_seed.setdefault(seed, set()).add((depth, init))
    every = set().union(*by_seed.values()) if by_seed else set()
    return sorted(s for s, got in by_seed.items() if got == every)


def study_scale(store: Store, sweep: str, *, finished_only: bool = True) -> dict[str, Any]:
    """What a sweep ran: the distinct values of each :data:`SCALE_KEYS` setting over its
    trials, the grid depths and seeds, and the seeds of every arm."""
    rows = trial_rows(store, sweep)
    if finished_only:
        rows = [r for r in rows if r["status"] == "terminated"] or rows
    out: dict[str, Any] = {}
    for key, _ in SCALE_KEYS:
        vals = set()
        for r in rows:
            c = r["config"]
            if key == "warmup":
                frac = float(c.get("warmup_frac") or 0.0)
                v = (int(round(frac * c["max_steps"])) if frac > 0 and "max_steps" in c
                     else c.get("warmup_steps"))
            elif key == "betas":
                v = (c.get("beta1"), c.get("beta2")) if "beta1" in c else None
            else:
                v = c.get(key)
            if v is not None:
                vals.add(v)
        out[key] = sorted(vals, key=str)
    grid = [r for r in rows if r["arm"] == BASELINE_ARM]
    out["depths"] = sorted({r["depth"] for r in grid})
    out["inits"] = sorted({r["init"] for r in grid})
    out["grid_seeds"] = grid_seed_list((r["seed"], r["depth"], r["init"]) for r in grid)
    out["arm_seeds"] = {a: sorted({r["seed"] for r in rows if r["arm"] == a})
                        for a in sorted({r["arm"] for r in rows} - {BASELINE_ARM})}
    out["n_trials"] = len(rows)
    return out


def test_loss_pairs(store: Store, sweep: str, *, arm: str, baseline: str = BASELINE_ARM
                    ) -> list[dict[str, Any]]:
    """Final test loss of each finished ``arm`` trial beside its paired baseline (same
    depth, init and seed): depth, init, seed, arm_test_loss, baseline_test_loss."""
    rows = [r for r in trial_rows(store, sweep) if r["status"] == "terminated"]
    base = {(r["cell"], r["depth"], r["init"], r["seed"]): r["test_loss"] for r in rows
            if r["arm"] == baseline}
    return [{"depth": r["depth"], "init": r["init"], "seed": r["seed"],
             "arm_test_loss": r["test_loss"],
             "baseline_test_loss": base.get((r["cell"], r["depth"], r["init"], r["seed"]))}
            for r in rows if r["arm"] == arm]


def select_trials(store: Store, sweep: str, *, arms: list[str] | None = None,
                   depth: int | None = None, init: str | None = None,
                   finished_only: bool = True) -> pl.DataFrame:
    t = sweep_trials(store, sweep, "cell")
    if t.height == 0:
        raise AnalysisError(f"sweep {sweep!r} has no trials yet; run it with "
                            f"`qkgeom sweep` first")
    require_one_cell(t, sweep)
    t = t.drop("cell")
    what = []
    if arms is not None:
        t = t.filter(pl.col("arm").is_in(arms))
        what.append(f"arm {'/'.join(arms)}")
    if depth is not None:
        depths = sorted(set(t["depth"].to_list()))
        t = t.filter(pl.col("depth") == depth)
        if t.height == 0:
            raise AnalysisError(f"sweep {sweep!r} has no trials at depth {depth}; depths "
                                f"present: {', '.join(map(str, depths)) or '(none)'}")
    if init is not None:
        inits = sorted(set(t["init"].to_list()))
        t = t.filter(pl.col("init") == init)
        if t.height == 0:
            raise AnalysisError(f"sweep {sweep!r} has no trials with init {init!r}; inits "
                                f"present: {', '.join(inits) or '(none)'}")
    if t.height == 0:
        raise AnalysisError(f"sweep {sweep!r} has no trials with {', '.join(what)}")
    if finished_only:
        done = t.filter(pl.col("status") == "terminated")
        if done.height == 0:
            counts = ", ".join(f"{s} {n}" for s, n in
                               t.group_by("status").len().sort("status").iter_rows())
            raise AnalysisError(
                f"none of the {t.height} matching trials of sweep {sweep!r} has finished "
                f"(status: {counts}); wait for them, or pass --include-unfinished to "
                "analyse partial runs")
        t = done
    return t


def require_one_cell(t: pl.DataFrame, sweep: str | Scope) -> None:
    """Refuse to pool trials of several cells (factor settings) into one statistic: its
    units, pairs and calibrated error rates are those of one cell."""
    cells = sorted({c for c in t["cell"].to_list() if c is not None})
    if len(cells) > 1:
        shown = ", ".join(cells[:6]) + (f" (and {len(cells) - 6} more)" if len(cells) > 6
                                        else "")
        raise AnalysisError(
            f"sweep {sweep!r} has {len(cells)} cells ({shown}); a statistic reads one: "
            f"pick it with --where cell={cells[0]} (or by its factors, e.g. --where "
            "n_embd=48), or run `qkgeom report`, which decides every claim in every cell")


def arms_summary(store: Store, sweep: str) -> pl.DataFrame:
    """Trials per (arm, depth, init, status)."""
    return sweep_trials(store, sweep).group_by(["arm", "depth", "init", "status"]).len().sort(
        ["arm", "depth", "init", "status"])
