"""``qkgeom.open_study``: DataFrames, statistics and charts of a planted study, and the
docs/python-api.md example run as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
from stats_fixtures import make_synthetic_db, write_pretrained_family, write_trials

import qkgeom
from qkgeom.errors import QkgeomError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> str:
    d = tmp_path_factory.mktemp("study")
    url = "sqlite:///" + str(d / "study.db")
    make_synthetic_db(url, sweep="smoke", seeds=5)
    write_pretrained_family(url)
    # a second sweep still running: 2 trials probed up to step 20 of 100
    write_trials(url, "live", [
        {"depth": 2, "init": "gaussian", "arm": "none", "seed": s, "status": "running",
         "values": lambda step, layer: {"pr_q": 10.0 + step / 100, "pr_k": 9.0}}
        for s in (0, 1)], steps=[0, 10, 20], max_steps=100)
    return url


def test_frames_match_the_planted_values(planted: str) -> None:
    with qkgeom.open_study(planted, "smoke") as s:
        t = s.trials()
        # 2 depths x 3 inits x 5 seeds grid + 2 arms x 5 seeds
        assert t.height == 40 and set(t["status"]) == {"terminated"}
        assert set(t["step"]) == {100} and set(t["max_steps"]) == {100}
        assert s.progress() == {"n_trials": 40, "status": {"terminated": 40}, "stale": 0,
                                "fraction": 1.0, "finished": True}
        # baseline pr_k = 12 + 0.14 p + layer - (0.5 + p); at p = 1, layer 1: 11.64
        traj = s.trajectories("pr_k", arm="none")
        row = traj.filter((traj["depth"] == 3) & (traj["init"] == "tied")
                          & (traj["layer"] == 1) & (traj["step"] == 100))
        assert row["value"][0] == pytest.approx(12 + 0.14 + 1 - 1.5)
        assert row["n_seeds"][0] == 5
        per = s.trajectories("pr_k", per_trial=True)
        assert per.height == 40 * 11 * 2 + 15 * 11 * 1  # 11 probes; depth-3 trials: 3 layers
        fin = s.finals("pr_q")
        assert set(fin["step"]) == {100}
        assert fin.filter(fin["layer"] == 2)["value"].to_list() == pytest.approx(
            [12.14 + 2] * 15)
        arms = s.arms()
        # pr_wk at p = 1 is (60 - 50) * (1 + key_effect): shrink -0.4, hold +0.4
        assert arms.height == 10
        for arm, want in (("shrink", 6.0), ("hold", 14.0)):
            a = arms.filter(arms["arm"] == arm)
            assert a["pr_wk"].to_list() == pytest.approx([want] * 5)
            assert a["baseline_pr_wk"].to_list() == pytest.approx([10.0] * 5)
        pre = s.pretrained()
        assert pre["model"].to_list() == ["synthetic/pythia-like"]
        assert pre["n_checkpoints"][0] == 8


def test_statistics_are_the_cli_results(planted: str) -> None:
    with qkgeom.open_study(planted, "smoke") as s:
        r = s.sign_test().result
        assert (r.n, r.n_positive) == (15, 15)
        assert r.p_value == pytest.approx(2.0 ** -15)  # exact binomial tail, all 15 positive
        sl = s.slopes()
        assert sl.pr_q.mean == pytest.approx(0.14)  # q_slope
        verdicts = {c.key: c.verdict for c in s.claims()}
        assert verdicts["2-gap"] == "holds"
        # shrink is the primary arm, tested alone: 5 seeds all lower reach 1/32; one
        # pretrained model cannot be "several"
        assert verdicts["4-shrink"] == "holds"
        assert verdicts["5"] == "not enough data"


def test_running_sweep_progress_and_no_finished_data(planted: str) -> None:
    with qkgeom.open_study(planted, "live") as s:
        p = s.progress()
        assert p["status"] == {"running": 2} and not p["finished"]
        assert p["fraction"] == pytest.approx(0.2)  # step 20 of 100
        assert s.trials()["val_loss"].to_list() == [1.0, 1.0]
        assert s.arms().height == 0
        with pytest.raises(QkgeomError, match="include-unfinished"):
            s.sign_test()
        r = s.sign_test(finished_only=False).result
        assert (r.n, r.n_positive) == (2, 2)
        chart = s.chart("metric", metric="pr_q", finished_only=False).to_dict()
        vals = chart["datasets"][next(iter(chart["datasets"]))]
        assert max(v["value"] for v in vals) == pytest.approx(10.2)


def test_charts(planted: str) -> None:
    with qkgeom.open_study(planted, "smoke") as s:
        for kind in ("trajectories", "intervention", "correlation"):
            d = s.chart(kind).to_dict()
            assert "datasets" in d and d["datasets"], kind
        d = s.chart("metric", metric="entropy", per_trial=True).to_dict()
        assert d["spec"]["mark"]["type"] == "line"
        assert d["spec"]["encoding"]["detail"]["field"] == "seed"
        with pytest.raises(QkgeomError, match="unknown chart"):
            s.chart("pie")


def test_checkpoint_trend_chart_matches_the_planted_family(planted: str) -> None:
    # planted (stats_fixtures.write_pretrained_family): PR_Q - PR_K = 1 + k up to the peak
    # at checkpoint k = 3 (step 4000), then 4 - 0.6 (k - 3), the same in every layer
    steps = [0, 1000, 2000, 4000, 8000, 16000, 32000, 64000]
    want = [1 + k if k <= 3 else 4 - 0.6 * (k - 3) for k in range(8)]
    with qkgeom.open_study(planted, "smoke") as s:
        df = s.checkpoint_frame()
        d = s.chart("checkpoints").to_dict()
    assert df["step"].to_list() == steps
    assert df["value"].to_list() == pytest.approx(want)
    assert df.filter(pl.col("peak"))["step"].to_list() == [4000]
    assert [lay["mark"]["type"] for lay in d["layer"]] == ["line", "point"]
    rows = d["datasets"][next(iter(d["datasets"]))]
    assert [r["value"] for r in rows] == pytest.approx(want)


def test_per_seed_trajectories_chart_has_pr_q_and_pr_k_of_every_seed(planted: str) -> None:
    with qkgeom.open_study(planted, "smoke") as s:
        d = s.chart("trajectories", per_trial=True).to_dict()
        per = {m: s.trajectories(m, per_trial=True, arm="none") for m in ("pr_q", "pr_k")}
    assert "one pair of lines per seed" in d["title"]
    assert {f["field"] for f in d["spec"]["encoding"]["detail"]} == {"metric", "seed"}
    rows = d["datasets"][next(iter(d["datasets"]))]
    assert {r["metric"] for r in rows} == {"PR_Q", "PR_K"}
    assert {r["seed"] for r in rows} == set(range(5))
    # one planted point, read back through the chart: depth 2, gaussian, seed 3, layer 1,
    # the last probe (progress 1) of each metric
    for m, label in (("pr_q", "PR_Q"), ("pr_k", "PR_K")):
        want = per[m].filter((pl.col("depth") == 2) & (pl.col("init") == "gaussian")
                             & (pl.col("seed") == 3) & (pl.col("layer") == 1)
                             & (pl.col("progress") == 1.0))["value"].item()
        got = [r["value"] for r in rows if r["metric"] == label and r["depth"] == 2
               and r["init"] == "gaussian" and r["seed"] == 3 and r["layer"] == 1
               and r["progress"] == 1.0]
        assert got == [pytest.approx(want)]


def test_bad_names(planted: str) -> None:
    with pytest.raises(QkgeomError, match="no sweep named 'nope'.*live, smoke"):
        qkgeom.open_study(planted, "nope")
    with pytest.raises(QkgeomError, match="2 sweeps"):
        qkgeom.open_study(planted)
    with qkgeom.open_study(planted, "smoke") as s:
        with pytest.raises(QkgeomError, match="unknown metric 'bogus'"):
            s.trajectories("bogus")
        with pytest.raises(QkgeomError, match="unknown metric"):
            s.finals("pr_q'; DROP TABLE trials; --")


def test_import_stays_lazy() -> None:
    code = ("import sys, qkgeom; heavy = [m for m in ('polars', 'altair', 'sqlalchemy') "
            "if m in sys.modules]; assert not heavy, heavy; "
            "assert callable(qkgeom.open_study)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_docs_example_runs(planted: str, tmp_path: Path, monkeypatch, capsys) -> None:
    text = (ROOT / "docs" / "python-api.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 1
    db = tmp_path / "study.db"
    make_synthetic_db("sqlite:///" + str(db), sweep="smoke", seeds=5)
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    exec(compile(blocks[0], "docs/python-api.md", "exec"), ns)
    out = capsys.readouterr().out
    assert "{'terminated': 40} 100% done" in out
    assert "15 of 15 trajectories with PR_Q > PR_K, p = 3.0517578125e-05" in out
    assert ns["claims"][0].key == "2-gap" and ns["claims"][0].verdict == "holds"
    assert ns["shrink"].result.n_seeds == 5 and ns["shrink"].result.mean_delta < 0
    assert ns["arms"].height == 10 and ns["models"].height == 0
    assert ns["live"].to_dict()["spec"]["mark"]["type"] == "line"
