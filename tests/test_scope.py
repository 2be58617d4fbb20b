"""Filters on a sweep's trials (``--where FACTOR=VALUE``, ``--seeds``) and statistics on a
sweep with cells, driven through the CLI as a user runs them, on a synthetic two-cell
sweep whose answers are known; and the sensitivity table on hand-made cell verdicts."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from helpers import run

from qkgeom.records import ProbeRecord
from qkgeom.report.claims import HOLDS, NOT_SHOWN
from qkgeom.report.sensitivity import (
    CellVerdicts,
    Factor,
    across_cells,
    changes,
    flips,
    sensitivity_table,
)

STEPS = [0, 50, 100]
# cell -> (config factors, PR_Q - PR_K planted in every layer and probe)
CELLS = {"e48": ({"n_embd": 48, "lr": 0.001}, 1.0), "e64": ({"n_embd": 64, "lr": 0.001}, -1.0)}
INITS = ("gaussian", "tied", "orthogonal")  # 3 x 2 layers: 6 trajectories, p = 1/64
SEEDS = (0, 1, 2, 3, 4)  # 2-gap needs 5 seeds (its unit) to reach p < 0.05


@pytest.fixture(scope="module")
def two_cells(tmp_path_factory: pytest.TempPathFactory) -> str:
    from qkgeom.store import open_store

    url = "sqlite:///" + str(tmp_path_factory.mktemp("cells") / "cells.db")
    with open_store(url) as store:
        sid = store.ensure_sweep("ladder", {"synthetic": True}, "synthetic")
        for cell, (factors, gap) in CELLS.items():
            for init in INITS:
                for seed in SEEDS:
                    cfg = {**factors, "max_steps": 100, "n_layer": 2, "init": init,
                           "seed": seed}
                    tid = store.ensure_trial(sid, f"{cell}.d2-{init}-none-s{seed}", cfg,
                                             depth=2, init=init, arm="none", seed=seed,
                                             cell=cell)
                    recs = [ProbeRecord(step=s, progress=s / 100, tokens=s,
                                        train_loss=float("nan"), val_loss=1.0, lr=1e-3,
                                        tokens_per_s=0.0,
                                        metrics=[m for layer in range(2) for m in (
                                            (layer, None, "pr_q", 5.0 + gap + 0.01 * seed),
                                            (layer, None, "pr_k", 5.0))])
                            for s in STEPS]
                    store.write_probes(tid, recs)
                    store.set_trial_status(tid, "terminated")
    return url


def sign(url: str, *extra: str) -> dict:
    code, out = run("stats", "sign-test", "--db", url, "--sweep", "ladder", *extra,
                    "--format", "json")
    assert code == 0, out
    return json.loads(out)


def digest(url: str) -> str:
    return hashlib.sha256(Path(url.removeprefix("sqlite:///")).read_bytes()).hexdigest()


def test_where_picks_one_cell_and_the_answer_is_that_cells(two_cells):
    before = digest(two_cells)
    pos = sign(two_cells, "--where", "n_embd=48")
    # a trajectory is a (depth, init, layer), averaged over seeds: 3 inits x 2 layers
    n = len(INITS) * 2
    assert (pos["n"], pos["n_positive"], pos["p_value"]) == (n, n, 2.0 ** -n)
    assert pos["sweep"] == "ladder" and pos["where"] == {"n_embd": ["48"]}
    neg = sign(two_cells, "--where", "cell=e64")
    assert (neg["n"], neg["n_positive"], neg["p_value"]) == (n, 0, 1.0)
    two = sign(two_cells, "--where", "n_embd=48", "--seeds", "0,1")
    assert (two["n"], two["n_positive"]) == (n, n)
    assert two["seeds"] == [0, 1]
    # lr=1e-3 is the stored 0.001: numbers compare as numbers
    one = sign(two_cells, "--where", "lr=1e-3", "--where", "n_embd=64", "--where",
               "init=tied")
    assert (one["n"], one["n_positive"]) == (2, 0)  # tied's two layers
    assert digest(two_cells) == before  # filters select; nothing is written


@pytest.mark.parametrize("extra, message", [
    ((), "has 2 cells (e48, e64); a statistic reads one: pick it with --where cell=e48"),
    (("--where", "lr=0.001"), "has 2 cells"),
    (("--where", "n_emb=48"), "has no factor 'n_emb' (did you mean 'n_embd'?)"),
    (("--where", "n_embd=50"), "no trial of sweep 'ladder' has that value; values "
                               "present: 48, 64"),
    (("--where", "n_embd"), "expected FACTOR=VALUE"),
    (("--seeds", "0,7"), "has no seed 7; seeds present: 0, 1, 2, 3, 4"),
    (("--seeds", "a"), "expected integers separated by commas"),
    (("--where", "n_embd=48", "--where", "cell=e64"), "together none"),
])
def test_bad_filters_and_pooled_cells_are_refused_in_one_line(two_cells, extra, message):
    before = digest(two_cells)
    code, out = run("stats", "sign-test", "--db", two_cells, "--sweep", "ladder", *extra)
    assert code != 0 and message in out, out
    assert "Traceback" not in out and len(out.strip().splitlines()) == 1, out
    assert digest(two_cells) == before


def test_every_statistic_takes_the_filter(two_cells):
    code, out = run("stats", "slopes", "--db", two_cells, "--sweep", "ladder", "--where",
                    "cell=e48", "--format", "json")
    assert code == 0, out
    assert json.loads(out)["where"] == {"cell": ["e48"]}


def test_report_decides_each_cell_alone_and_finds_the_factor_that_flips(two_cells, tmp_path):
    before = digest(two_cells)
    code, out = run("report", "--db", two_cells, "--sweep", "ladder", "--out",
                    str(tmp_path), "--boot", "200", "--format", "json")
    assert code == 0, out
    verdicts = json.loads(out)["verdicts"]
    # every trajectory and seed positive in e48 (5 of 5 seeds, p = 1/32), every one
    # negative in e64 (the opposite sign test, p = 1/32)
    assert (verdicts["e48"]["2-gap"], verdicts["e64"]["2-gap"]) == (HOLDS, "contradicted")
    rep = json.loads((tmp_path / "report.json").read_text())
    assert [c["label"] for c in rep["cells"]] == ["e48", "e64"]
    assert rep["factors"] == [{"name": "n_embd", "with": []}]  # lr is the same in both
    (gap,) = [r for r in rep["sensitivity"] if r["claim"] == "2-gap"]
    assert gap["n_embd"] == "flips" and gap["decided cells"] == "2 of 2"
    html = (tmp_path / "report.html").read_text()
    assert "Sensitivity: claim x factor" in html and "Cell e64" in html
    assert {p.name for p in tmp_path.glob("fig-*.png")} >= {"fig-e48-trajectories.png",
                                                             "fig-e64-trajectories.png"}
    assert digest(two_cells) == before


# ------------------------------------------------------------------- sensitivity table

def cells(verdicts: dict[tuple[int, float], str]) -> list[CellVerdicts]:
    return [CellVerdicts(f"e{w}-lr{lr:g}", {"n_embd": w, "lr": lr}, {"2": v})
            for (w, lr), v in verdicts.items()]


FACTORS = [Factor("n_embd", ("block_size",)), Factor("lr", ("min_lr",))]


def test_sensitivity_flips_where_one_factor_changes_the_verdict_at_fixed_others():
    # holds only at width 64, lr 0.003: along n_embd it flips at lr=0.003 (48 -> 64) and
    # not at lr=0.001; along lr it flips at n_embd=64 only
    c = cells({(32, 1e-3): NOT_SHOWN, (48, 1e-3): NOT_SHOWN, (64, 1e-3): NOT_SHOWN,
               (32, 3e-3): NOT_SHOWN, (48, 3e-3): NOT_SHOWN, (64, 3e-3): HOLDS})
    assert flips(c, "2", "n_embd", ["n_embd", "lr"]) == (2, ["lr=0.003"])
    assert flips(c, "2", "lr", ["n_embd", "lr"]) == (3, ["n_embd=64"])
    (row,) = sensitivity_table(c, ["2"], FACTORS)
    assert row == {"claim": "2", "decided cells": "6 of 6",
                   "n_embd (with block_size)": "flips (at lr=0.003)",
                   "lr (with min_lr)": "flips (at n_embd=64)"}


def test_the_ladder_line_names_the_width_where_the_verdict_changes():
    # the ladder of docs/findings.md: 2-gap holds only at 128, which has lr 1e-3 only; an
    # undecided cell (96) is passed over; widths in numeric order (128 after 64)
    c = cells({(128, 1e-3): HOLDS, (32, 1e-3): NOT_SHOWN, (64, 1e-3): NOT_SHOWN,
               (96, 1e-3): "not enough data", (32, 3e-3): NOT_SHOWN, (64, 3e-3): NOT_SHOWN})
    assert changes(c, "2", "n_embd", ["n_embd", "lr"]) == [
        "64 -> 128: not shown -> holds, at lr=0.001"]
    assert changes(c, "2", "lr", ["n_embd", "lr"]) == []
    assert across_cells(c, "2", FACTORS) == (
        "holds in 1 of 6 cells, 1 undecided; flips with n_embd "
        "(64 -> 128: not shown -> holds, at lr=0.001)")
    # a verdict that changes twice along the factor: both changes
    c = cells({(32, 1e-3): NOT_SHOWN, (48, 1e-3): HOLDS, (64, 1e-3): NOT_SHOWN})
    assert changes(c, "2", "n_embd", ["n_embd", "lr"]) == [
        "32 -> 48: not shown -> holds, at lr=0.001",
        "48 -> 64: holds -> not shown, at lr=0.001"]


def test_sensitivity_is_stable_or_not_compared_when_nothing_flips():
    same = cells({(32, 1e-3): NOT_SHOWN, (48, 1e-3): NOT_SHOWN, (32, 3e-3): NOT_SHOWN,
                  (48, 3e-3): NOT_SHOWN})
    (row,) = sensitivity_table(same, ["2"], FACTORS)
    assert row["n_embd (with block_size)"] == "stable (2 comparisons)"
    assert row["lr (with min_lr)"] == "stable (2 comparisons)"
    # undecided cells are left out: no two decided cells differ in lr alone
    part = cells({(32, 1e-3): NOT_SHOWN, (48, 1e-3): HOLDS, (32, 3e-3): "undecided",
                  (48, 3e-3): "undecided"})
    (row,) = sensitivity_table(part, ["2"], FACTORS)
    assert row == {"claim": "2", "decided cells": "2 of 4",
                   "n_embd (with block_size)": "flips (at lr=0.001)",
                   "lr (with min_lr)": "not compared"}
