"""studies/ladder.py end to end on a synthetic cell whose values are known by hand: its
tables through the public CLI (``qkgeom report`` / ``qkgeom query``), and ``--per-seed`` on
database copies that leave the cell's own database untouched."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from stats_fixtures import make_synthetic_db

from qkgeom.report.claims import compute_claims
from qkgeom.store import open_store

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "studies" / "ladder.py"


def test_ladder_script_tables_and_per_seed_copies(tmp_path: Path) -> None:
    db = tmp_path / "cell.db"
    sweep = "ladder-t"
    # grid: depths 2, 3 x 3 inits x seeds 0, 1; arms hold, shrink at seeds 0, 1. Planted at
    # the last probe (progress 1): PR_Q = 12 + 0.14 + layer, PR_K = PR_Q - 1.5.
    make_synthetic_db(f"sqlite:///{db}", sweep=sweep, seeds=[0, 1], depths=(2, 3))
    digest = hashlib.sha256(db.read_bytes()).hexdigest()
    env = dict(os.environ, PATH=str(Path(sys.executable).parent) + os.pathsep
               + os.environ.get("PATH", ""))
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--cell", f"t={db}:{sweep}", "--reports",
         str(tmp_path / "reports"), "--json", str(tmp_path / "cells.json"),
         "--per-seed", str(tmp_path / "per-seed")],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr
    (cell,) = json.loads((tmp_path / "cells.json").read_text())

    assert (cell["label"], cell["sweep"], cell["trials"], cell["terminated"]) == (
        "t", sweep, 2 * 3 * 2 + 2 * 2, 16)
    # every (trial, layer) unit has PR_Q > PR_K: 3 inits x (2 + 3) layers per seed
    assert cell["gap_per_seed"] == {"0": [15, 15], "1": [15, 15]}
    ll = cell["last_layer"]
    assert set(ll) == {"2", "3"}
    assert ll["2"]["pr_q"] == pytest.approx(13.14) and ll["2"]["pr_k"] == pytest.approx(11.64)
    assert ll["3"]["pr_q"] == pytest.approx(14.14) and ll["3"]["pr_k"] == pytest.approx(12.64)
    assert all((v["q_gt_k"], v["n"]) == (6, 6) for v in ll.values())
    assert cell["test_loss"] == {"hold": None, "none": None, "shrink": None}  # none stored

    # the verdicts are the report's, as computed in-process on the same database
    with open_store(f"sqlite:///{db}") as st:
        want = {c.key: c.verdict for c in compute_claims(st, sweep).claims}
    assert cell["verdicts"] == {k: want[k] for k in cell["verdicts"]}
    assert {"2-gap", "3", "4-shrink", "4-hold"} <= set(cell["verdicts"])

    # --per-seed: one copy per grid seed with the other seed's grid trials marked error
    assert set(cell["per_seed"]) == {"0", "1"}
    for seed in (0, 1):
        con = sqlite3.connect(tmp_path / "per-seed" / f"t-seed{seed}.db")
        err = con.execute("SELECT arm, seed FROM trials WHERE status = 'error'").fetchall()
        con.close()
        assert sorted(err) == [("none", 1 - seed)] * 6
        assert set(cell["per_seed"][str(seed)]) == {"2-gap", "2-slopes", "2-slopes-late",
                                                    "3"}
    assert hashlib.sha256(db.read_bytes()).hexdigest() == digest  # the cell's db unwritten
    assert "| claim | t |" in out.stdout and "| t | seed 0: 15/15, seed 1: 15/15 |" in out.stdout
