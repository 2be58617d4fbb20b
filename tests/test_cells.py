"""Factors beyond depth x init x seed (qkgeom.plan.cells): axes and named cells in a spec,
pairing within a cell, the errors, and a real sweep whose trials land in v_factors."""

from __future__ import annotations

import json

import pytest
from sweep_fixtures import run_cli

from qkgeom.plan.spec import SpecError, build_plan, plan_from, trial_key

SMALL = {
    "name": "cells",
    "trial": {"preset": "smoke", "overrides": {}},
    "grid": {"depths": [1], "inits": ["gaussian"], "seeds": [0]},
    "interventions": {"depth": 1, "init": "gaussian", "arms": ["hold"], "seeds": [0]},
}


def test_axes_cross_every_trial_with_every_value_and_arms_pair_within_their_cell():
    plain = build_plan(dict(SMALL))
    plan = build_plan(dict(SMALL, axes={"lr": [1e-3, 3e-3], "n_head": [1, 2]}))
    assert len(plan.trials) == 4 * len(plain.trials)
    cells = sorted({t.cell for t in plan.trials})
    assert cells == ["lr0.001-n_head1", "lr0.001-n_head2", "lr0.003-n_head1",
                     "lr0.003-n_head2"]
    by_key = plan.by_key()
    for t in plan.trials:
        assert t.key == trial_key(t.depth, t.init, t.arm, t.seed, t.cell)
        assert t.key.startswith(f"{t.cell}.")
        lr, heads = t.cell.split("-")
        assert t.config["lr"] == float(lr[2:]) and t.config["n_head"] == int(heads[6:])
        if t.baseline_key:  # the baseline of its own cell, with the same factor values
            b = by_key[t.baseline_key]
            assert b.cell == t.cell and b.arm == "none" and b.seed == t.seed
            assert (b.config["lr"], b.config["n_head"]) == (t.config["lr"], t.config["n_head"])
    # baselines of every cell run before any arm
    arms_at = [i for i, t in enumerate(plan.trials) if t.baseline_key]
    assert min(arms_at) == len(plan.trials) - len(arms_at)
    # without factors nothing changes: the plain keys, no cell
    assert [t.key for t in plain.trials] == ["d1-gaussian-none-s0", "d1-gaussian-hold-s0"]
    assert {t.cell for t in plain.trials} == {None}


def test_named_cells_couple_factors_and_cross_with_axes():
    spec = dict(SMALL, cells={"e32": {"n_embd": 32, "block_size": 32},
                              "e48": {"n_embd": 48, "block_size": 48}},
                axes={"lr": [1e-3, 3e-3]})
    plan = build_plan(spec)
    got = sorted({(t.cell, t.config["n_embd"], t.config["block_size"], t.config["lr"])
                  for t in plan.trials})
    assert got == [("e32-lr0.001", 32, 32, 1e-3), ("e32-lr0.003", 32, 32, 3e-3),
                   ("e48-lr0.001", 48, 48, 1e-3), ("e48-lr0.003", 48, 48, 3e-3)]
    # --set reaches the sections like any other spec key
    plan = build_plan(dict(SMALL), sets=["axes.lr=[0.002]"])
    assert {t.cell for t in plan.trials} == {"lr0.002"}


@pytest.mark.parametrize("extra,message", [
    ({"axes": {"n_embed": [32]}}, "unknown factor 'n_embed' (did you mean 'n_embd'?)"),
    ({"axes": {"seed": [0, 1]}}, "axes.seed: set per trial by the sweep"),
    ({"axes": {"lr": []}}, "axes.lr: expected a non-empty list"),
    ({"axes": {"lr": [1e-3, 1e-3]}}, "axes.lr: duplicate values"),
    ({"axes": {"dataset": ["a b"]}}, "name the cells instead"),
    ({"cells": {"a/b": {"lr": 1e-3}}}, "cells: the name 'a/b' must be"),
    ({"cells": {"x": {"lr": "fast"}}}, "grid trial x.d1-gaussian-none-s0"),
    ({"cells": {"x": {"lr": 1e-3}}, "axes": {"lr": [1e-3]}}, "lr: both an axis and a value"),
    ({"axes": {"lr": [1e-3]}, "trial": {"preset": "smoke", "overrides": {"lr": 1e-3}}},
     "trial.overrides.lr: also a factor"),
    ({"axis": {"lr": [1e-3]}}, "axis"),
])
def test_bad_factors_get_one_line_that_names_the_key(extra, message):
    with pytest.raises(SpecError) as e:
        build_plan({**SMALL, **extra})
    assert message in str(e.value) and "\n" not in str(e.value)


def test_presets_keep_their_plain_keys():
    assert all(t.cell is None and "." not in t.key for t in plan_from("cpu").trials)


@pytest.mark.slow
def test_a_sweep_over_a_factor_stores_its_cells_and_groups_in_v_factors(scratch):  # noqa: F811
    spec = scratch / "cells.json"
    spec.write_text(json.dumps(dict(SMALL, axes={"lr": [1e-3, 3e-3]})))
    db = f"sqlite:///{scratch / 'cells.db'}"
    dry = run_cli(["sweep", "--dry-run", "--spec", str(spec)], scratch)
    assert json.loads(dry.stdout)["n_trials"] == 4
    run_cli(["sweep", "--spec", str(spec), "--db", db, "--snapshots", "none"], scratch,
            timeout=600)
    q = run_cli(["query", "--db", db, "--format", "json",
                 "SELECT cell, lr, arm, COUNT(*) AS n FROM v_factors "
                 "WHERE status = 'terminated' GROUP BY cell, lr, arm ORDER BY cell, arm"],
                scratch)
    rows = [tuple(r.values()) for r in json.loads(q.stdout)]
    assert rows == [("lr0.001", 1e-3, "hold", 1), ("lr0.001", 1e-3, "none", 1),
                    ("lr0.003", 3e-3, "hold", 1), ("lr0.003", 3e-3, "none", 1)]
