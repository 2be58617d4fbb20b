"""Statistics read from synthetic databases with known answers, through the CLI as a user
runs them (``qkgeom stats ...``) and through :mod:`qkgeom.analysis`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import run
from scipy.stats import spearmanr
from stats_fixtures import make_synthetic_db, write_pretrained_family


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> str:
    """PR_Q > PR_K everywhere; shrink lowers entropy by ~0.3, hold raises it by ~0.3."""
    url = "sqlite:///" + str(tmp_path_factory.mktemp("planted") / "planted.db")
    make_synthetic_db(url, sweep="planted", pr_gap=1.0, seeds=5)
    write_pretrained_family(url)
    return url


@pytest.fixture(scope="module")
def negative(tmp_path_factory: pytest.TempPathFactory) -> str:
    """PR_Q < PR_K everywhere, arms with no intervention arms at all, four seeds."""
    url = "sqlite:///" + str(tmp_path_factory.mktemp("neg") / "neg.db")
    make_synthetic_db(url, sweep="negative", pr_gap=-1.0, seeds=4, depths=(2,),
                      inits=("gaussian",), arms=())
    return url


def run_json(*args: str) -> dict:
    code, out = run(*args, "--format", "json")
    assert code == 0, out
    return json.loads(out)


# --------------------------------------------------------------------------- sign test


def test_sign_test_all_positive(planted):
    d = run_json("stats", "sign-test", "--db", planted)
    # depths (2, 3) x 3 inits: 15 trajectories, all positive
    assert (d["n"], d["n_positive"]) == (15, 15)
    assert d["p_value"] == 2.0**-15
    assert sum(c["n"] for c in d["by_depth_init"]) == 15


# PR_Q - PR_K at steps 10, 20, 30, 40 (step 0 is -100 everywhere: "mean" and "all" must
# leave it out). Per layer of a depth-7 trial: A, B, B, C, C, C, D.
GAPS = {"A": [1, 1, 1, 1],  # final +, mean +, all +
        "B": [2, -1, 2, 2],  # final +, mean +, all -
        "C": [-5, -5, -5, 1],  # final +, mean -, all -
        "D": [3, 3, 3, -1]}  # final -, mean +, all -
LAYER_GAPS = "ABBCCCD"
# positives per summary among the 7 layers: final 6, mean 4, all 1
SUMMARY_POSITIVE = {"final": 6, "mean": 4, "all": 1}


@pytest.fixture(scope="module")
def summaries_db(tmp_path_factory: pytest.TempPathFactory) -> str:
    from stats_fixtures import write_trials

    url = "sqlite:///" + str(tmp_path_factory.mktemp("summ") / "summ.db")

    def values(step, layer):
        gap = -100.0 if step == 0 else GAPS[LAYER_GAPS[layer]][step // 10 - 1]
        return {"pr_k": 10.0 + layer, "pr_q": 10.0 + layer + gap}

    write_trials(url, "summaries", [dict(depth=7, init="gaussian", arm="none", seed=s,
                                         values=values) for s in (0, 1)],
                 steps=[0, 10, 20, 30, 40], max_steps=40)
    return url


@pytest.mark.parametrize("level", ["trajectory", "run"])
@pytest.mark.parametrize("summary", ["final", "mean", "all"])
def test_sign_test_summaries_and_run_level(summaries_db, summary, level):
    from scipy.stats import binomtest

    d = run_json("stats", "sign-test", "--db", summaries_db, "--summary", summary, "--level",
                 level)
    # two identical seeds: 7 trajectories (mean over seeds) or 14 (trial, layer) units
    per = 1 if level == "trajectory" else 2
    n, k = 7 * per, SUMMARY_POSITIVE[summary] * per
    assert (d["n"], d["n_positive"], d["n_zero"]) == (n, k, 0)
    assert d["p_value"] == pytest.approx(binomtest(k, n, 0.5, alternative="greater").pvalue,
                                         rel=1e-12)


def test_sign_test_filters(planted):
    d = run_json("stats", "sign-test", "--db", planted, "--depth", "3", "--init", "tied")
    assert (d["n"], d["n_positive"], d["p_value"]) == (3, 3, 1 / 8)


def test_sign_test_all_negative(negative):
    d = run_json("stats", "sign-test", "--db", negative, "--sweep", "negative")
    assert (d["n"], d["n_positive"], d["p_value"]) == (2, 0, 1.0)
    code, out = run("stats", "sign-test", "--db", negative)
    assert code == 0 and "0 of 2 positive" in out and "<= 0" in out


def test_sign_test_table_output(planted):
    code, out = run("stats", "sign-test", "--db", planted)
    assert code == 0
    assert "15 of 15 positive" in out and "p = 3.052e-05" in out


# --------------------------------------------------------------------------- slopes


def test_slopes_known(planted):
    d = run_json("stats", "slopes", "--db", planted)
    assert d["pr_q"]["mean"] == pytest.approx(0.14)
    assert d["pr_k"]["mean"] == pytest.approx(0.14 - 1.0)
    assert d["pr_q"]["share_positive"] == 1.0 and d["pr_k"]["share_positive"] == 0.0
    assert len(d["slopes"]) == 15
    code, out = run("stats", "slopes", "--db", planted, "--level", "run")
    assert code == 0 and "PR_Q" in out


# --------------------------------------------------------------------------- directional


def test_directional_planted_effects(planted):
    s = run_json("stats", "directional-confidence", "--db", planted, "--arm", "shrink")
    assert s["n_seeds"] == 5
    assert -0.4 < s["mean_delta"] < -0.2
    assert s["ci_low"] < s["mean_delta"] < s["ci_high"] < 0
    assert s["directional_confidence"] == 1.0
    assert s["sign_test_p"] == 1 / 32
    assert s["key_check"]["pr_wk"]["n_lower"] == 5
    h = run_json("stats", "directional-confidence", "--db", planted, "--arm", "hold")
    assert h["mean_delta"] > 0.15 and h["directional_confidence"] == 1.0
    assert h["predicted_sign"] == 1
    # overriding the prediction flips the confidence
    w = run_json("stats", "directional-confidence", "--db", planted, "--arm", "hold",
                 "--predicted-sign", "-1")
    assert w["directional_confidence"] == 0.0 and w["sign_test_p"] == 1.0


def test_directional_per_layer_and_metric(planted):
    d = run_json("stats", "directional-confidence", "--db", planted, "--arm", "shrink",
                 "--per-layer", "--metric", "pr_k", "--window", "1", "--boot", "20000")
    assert [r["layer"] for r in d["per_layer"]] == [0, 1]
    # planted (stats_fixtures): at the last probe (p = 1) the baseline's layer-l PR_K is
    # 12 + 0.14 + l - 1.5 and shrink scales it by 1 - 0.4, in every seed: delta = -0.4 x it.
    # A window of 3 probes (the default) would average p = 0.8, 0.9, 1 and give other values.
    for r in d["per_layer"]:
        want = -0.4 * (12 + 0.14 + r["layer"] - 1.5)
        assert r["n_seeds"] == 5 and r["n_agree"] == 5
        assert r["mean_delta"] == pytest.approx(want, rel=1e-9)
        assert r["sd_delta"] == pytest.approx(0.0, abs=1e-9)  # the same in every seed
        assert r["directional_confidence"] == 1.0 and r["sign_test_p"] == 1 / 32
    assert d["metric"] == "pr_k" and d["n_seeds"] == 5
    assert d["mean_delta"] == pytest.approx(-0.4 * (12 + 0.14 + 0.5 - 1.5), rel=1e-9)
    assert d["n_boot"] == 20000 and d["window"] == 1


def test_same_seed_byte_identical(planted):
    args = ("stats", "directional-confidence", "--db", planted, "--arm", "hold", "--seed", "5")
    a, b = run(*args), run(*args)
    assert a == b and a[0] == 0
    ja = run("stats", "correlate", "--db", planted, "--x", "pr_k", "--y", "entropy",
             "--seed", "3", "--format", "json")
    jb = run("stats", "correlate", "--db", planted, "--x", "pr_k", "--y", "entropy",
             "--seed", "3", "--format", "json")
    assert ja == jb
    jc = run("stats", "correlate", "--db", planted, "--x", "pr_k", "--y", "entropy",
             "--seed", "4", "--format", "json")
    assert jc != ja


# --------------------------------------------------------------------------- correlate


def pooled_points(url: str, mx: str, my: str, arm: str | None = None):
    """(x, y, depth) per (trial, probe, layer) of finished trials, read with plain SQL."""
    from sqlalchemy import create_engine, text

    eng = create_engine(url)
    try:
        with eng.connect() as conn:
            rows = conn.execute(text(
                "SELECT m.trial_id, m.step, m.layer, m.metric, m.value, t.depth, t.arm "
                "FROM probe_metrics m JOIN trials t ON t.id = m.trial_id "
                "WHERE m.head_key = -1 AND t.status = 'terminated' AND m.metric IN (:x, :y)"),
                {"x": mx, "y": my}).all()
    finally:
        eng.dispose()
    pts: dict = {}
    for tid, step, layer, metric, value, depth, a in rows:
        if arm is None or a == arm:
            pts.setdefault((tid, step, layer), {"depth": depth})[metric] = value
    keep = [p for p in pts.values() if p.get(mx) is not None and p.get(my) is not None]
    return (np.array([p[mx] for p in keep]), np.array([p[my] for p in keep]),
            np.array([p["depth"] for p in keep]))



def test_correlate(planted):
    d = run_json("stats", "correlate", "--db", planted, "--x", "pr_k", "--y", "qk_erank")
    assert d["rho"] == pytest.approx(1.0)
    d = run_json("stats", "correlate", "--db", planted, "--x", "pr_k", "--y", "entropy",
                 "--boot", "200")
    assert 0 < d["ci_low"] < d["rho"] < d["ci_high"]
    assert [b["depth"] for b in d["by_depth"]] == [2, 3]
    # the same pooled points read with plain SQL, ranked by scipy: one point per
    # (trial, probe, layer), every arm
    x, y, depth = pooled_points(planted, "pr_k", "entropy")
    assert d["n"] == len(x) == 11 * (15 * 2 + 15 * 3 + 10 * 2)
    assert d["rho"] == pytest.approx(spearmanr(x, y).statistic, rel=1e-12)
    for b in d["by_depth"]:
        sel = depth == b["depth"]
        assert b["n"] == int(sel.sum())
        assert b["rho"] == pytest.approx(spearmanr(x[sel], y[sel]).statistic, rel=1e-12)
    # the CI resamples whole trials: 2 depths x 3 inits x 5 seeds + 2 arms x 5 seeds
    assert d["resample"] == "clusters" and d["bootstrap"] == "cluster bootstrap over trials"
    assert d["n_clusters"] == 40 == sum(b["n_clusters"] for b in d["by_depth"])


# --------------------------------------------------------------------------- pretrained


def test_checkpoint_trend(planted):
    d = run_json("stats", "checkpoint-trend", "--db", planted, "--model",
                 "synthetic/pythia-like")
    assert d["rises_then_decays"] is True and d["peak_step"] == 4000
    assert d["n_layers_rise_then_decay"] == 3
    assert d["rank_entropy_link"]["rho"] == pytest.approx(1.0)
    code, out = run("stats", "checkpoint-trend", "--db", planted, "--model", "nope/x")
    assert code != 0 and "synthetic/pythia-like" in out


# --------------------------------------------------------------------------- errors


def test_unknown_sweep_lists_existing(planted):
    code, out = run("stats", "sign-test", "--db", planted, "--sweep", "nope")
    assert code == 1
    assert "no sweep named 'nope'" in out and "planted" in out


def test_several_sweeps_need_a_name(tmp_path):
    url = "sqlite:///" + str(tmp_path / "two.db")
    make_synthetic_db(url, sweep="a", seeds=2, depths=(2,), inits=("gaussian",), arms=())
    make_synthetic_db(url, sweep="b", seeds=2, depths=(2,), inits=("gaussian",), arms=())
    code, out = run("stats", "slopes", "--db", url)
    assert code == 1 and "--sweep" in out and "a, b" in out
    assert run_json("stats", "slopes", "--db", url, "--sweep", "b")["pr_q"]["n"] == 2


def test_no_intervention_arms(negative):
    code, out = run("stats", "directional-confidence", "--db", negative, "--arm", "shrink")
    assert code == 1 and "no intervention arms" in out
    code, out = run("plot", "intervention", "--db", negative, "--out", "x.png")
    assert code == 1 and "no intervention arms" in out


def test_too_few_seeds_says_how_many(tmp_path):
    url = "sqlite:///" + str(tmp_path / "few.db")
    make_synthetic_db(url, sweep="few", seeds=[0, 1, 2], arm_seeds=[2, 7], depths=(2,),
                      inits=("gaussian",), arms=("shrink",))
    code, out = run("stats", "directional-confidence", "--db", url, "--arm", "shrink")
    assert code == 1
    assert "too few seeds" in out
    assert "arm 'shrink' has 2 seeds [2, 7]" in out
    assert "baseline 'none' has 3 seeds [0, 1, 2]" in out
    code, out = run("stats", "directional-confidence", "--db", url, "--arm", "hold")
    assert code == 1 and "arms present: none, shrink" in out


def test_unknown_metric_lists_valid(planted):
    code, out = run("stats", "correlate", "--db", planted, "--x", "pr_z", "--y", "entropy")
    assert code == 1 and "unknown metric 'pr_z'" in out
    assert "pr_k" in out and "token_erank" in out
    code, out = run("stats", "directional-confidence", "--db", planted, "--arm", "shrink",
                    "--metric", "entropyy")
    assert code == 1 and "unknown metric 'entropyy'" in out


def test_bad_options(planted):
    code, out = run("stats", "directional-confidence", "--db", planted, "--arm", "shrink",
                    "--boot", "500")
    assert code == 1 and "at least 10000" in out
    code, out = run("stats", "directional-confidence", "--db", planted, "--arm", "other")
    assert code == 1 and "arms present" in out
    code, out = run("stats", "sign-test", "--db", planted, "--depth", "9")
    assert code == 1 and "depths present: 2, 3" in out


def test_unfinished_trials(tmp_path):
    url = "sqlite:///" + str(tmp_path / "run.db")
    make_synthetic_db(url, sweep="live", seeds=2, depths=(2,), inits=("gaussian",), arms=(),
                      status="running")
    code, out = run("stats", "sign-test", "--db", url)
    assert code == 1 and "running 2" in out and "--include-unfinished" in out
    d = run_json("stats", "sign-test", "--db", url, "--include-unfinished")
    assert d["n"] == 2


def test_missing_database(tmp_path):
    code, out = run("stats", "sign-test", "--db", str(tmp_path / "none.db"))
    assert code == 1 and "qkgeom db upgrade" in out
    assert not Path(tmp_path / "none.db").exists()


def test_empty_database_has_no_sweeps(tmp_path):
    from qkgeom.store import open_store

    url = "sqlite:///" + str(tmp_path / "empty.db")
    open_store(url).close()
    code, out = run("stats", "sign-test", "--db", url)
    assert code == 1 and "no sweeps" in out


# --------------------------------------------------------------------------- real sweep


@pytest.fixture(scope="module")
def smoke_db(tmp_path_factory: pytest.TempPathFactory, wikitext_dir: Path) -> str:
    """A database written by a real `qkgeom sweep --preset smoke` (Ray, ~1 min on CPU)."""
    import subprocess
    import sys

    d = tmp_path_factory.mktemp("smoke")
    url = "sqlite:///" + str(d / "smoke.db")
    r = subprocess.run([sys.executable, "-c", "from qkgeom.cli import main; main()", "sweep",
                        "--preset", "smoke", "--db", url, "--data", str(wikitext_dir),
                        "--storage", str(d / "ray")], capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    return url


@pytest.mark.slow
@pytest.mark.ray
def test_commands_on_a_real_smoke_sweep(smoke_db: str, tmp_path: Path):
    """Every command runs on real data; the sign test and Spearman are recomputed from the
    stored values (training outcomes vary, so nothing is planted here)."""
    from qkgeom import analysis as A
    from qkgeom.store import open_store

    with open_store(smoke_db, create=False, readonly=True) as store:
        t = A.sweep_trials(store, A.resolve_sweep(store, None))
    grid = t.filter(t["arm"] == "none")
    n_traj = sum(d for d, _ in grid.select("depth", "init").unique().iter_rows())
    d = run_json("stats", "sign-test", "--db", smoke_db)
    assert d["n"] + d["n_zero"] + d["n_dropped"] == n_traj
    # recomputed from the stored values (plain SQL): per (depth, init, layer) the final
    # probe's PR_Q - PR_K, mean over seeds; an exact one-sided binomial test by scipy
    from scipy.stats import binomtest
    from sqlalchemy import create_engine, text

    eng = create_engine(smoke_db)
    with eng.connect() as conn:
        rows = conn.execute(text(
            "SELECT t.depth, t.init, t.seed, m.step, m.layer, m.metric, m.value "
            "FROM probe_metrics m JOIN trials t ON t.id = m.trial_id WHERE m.head_key = -1 "
            "AND t.arm = 'none' AND m.metric IN ('pr_q', 'pr_k')")).all()
    eng.dispose()
    vals: dict = {}
    for depth, init, seed, step, layer, metric, value in rows:
        vals.setdefault((depth, init, layer), {}).setdefault(step, {}).setdefault(
            seed, {})[metric] = value
    finals = []
    for by_step in vals.values():
        last = by_step[max(by_step)]
        finals.append(np.mean([v["pr_q"] - v["pr_k"] for v in last.values()]))
    finals = np.array(finals)
    assert len(finals) == n_traj
    k, n = int((finals > 0).sum()), int((finals != 0).sum())
    assert (d["n"], d["n_positive"]) == (n, k)
    assert d["p_value"] == pytest.approx(binomtest(k, n, 0.5, alternative="greater").pvalue,
                                         rel=1e-12)
    s = run_json("stats", "slopes", "--db", smoke_db, "--level", "run")
    assert s["pr_q"]["n"] + s["pr_q"]["n_undefined"] == sum(grid["depth"].to_list())
    arms = sorted(set(t["arm"].to_list()) - {"none"})
    for arm in arms:
        r = run_json("stats", "directional-confidence", "--db", smoke_db, "--arm", arm,
                     "--window", "1")
        n_pairs = len(set(t.filter(t["arm"] == arm)["seed"].to_list()))
        assert r["n_seeds"] == n_pairs
        assert r["ci_low"] <= r["mean_delta"] <= r["ci_high"]
        assert set(r["key_check"]) == {"pr_wk", "pr_k"}
    c = run_json("stats", "correlate", "--db", smoke_db, "--x", "pr_k", "--y", "entropy")
    x, y, _ = pooled_points(smoke_db, "pr_k", "entropy")
    assert c["n"] == len(x) > 0
    assert c["rho"] == pytest.approx(spearmanr(x, y).statistic, rel=1e-9)
    for kind in ("trajectories", "intervention", "correlation"):
        out = tmp_path / f"{kind}.png"
        code, text = run("plot", kind, "--db", smoke_db, "--out", str(out))
        assert code == 0, text
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, text = run("report", "--db", smoke_db, "--out", str(tmp_path / "rep"))
    assert code == 0, text
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert {c["verdict"] for c in rep["claims"]} <= {"holds", "not shown", "contradicted",
                                                      "not enough data"}
    # by construction, not a training outcome: a baseline-fraction shrink arm ends with
    # W_K PR at half of its paired baseline's in every seed
    c = {c["key"]: c for c in rep["claims"]}
    kc = c["reality-check"]["numbers"]["shrink"]["pr_wk"]
    assert kc["n_lower"] == kc["n_seeds"] > 0
    # with fewer than 5 seeds "lower in every seed" is not rare enough by chance to decide
    assert c["reality-check"]["verdict"] == ("holds" if kc["n_seeds"] >= 5
                                             else "not enough data")
    assert rep["scale"]["n_embd"] == [32] and rep["scale"]["lr"] == [0.003]
    for window in ("late", "collapse", "0.5"):
        d = run_json("stats", "slopes", "--db", smoke_db, "--from", window)
        assert d["pr_q"]["n"] + d["pr_q"]["n_undefined"] == n_traj


# --------------------------------------------------------------------------- trend windows


@pytest.fixture(scope="module")
def collapsing(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    """Trajectories that collapse at step 10 + 5 * layer, then PR_Q rises and PR_K falls."""
    from stats_fixtures import make_collapse_db

    url = "sqlite:///" + str(tmp_path_factory.mktemp("collapse") / "collapse.db")
    return url, make_collapse_db(url)


def _np_window_slopes(info: dict, depth: int, init: str, layer: int, first_step: int
                      ) -> tuple[float, float]:
    """numpy reference: np.polyfit of the seed-mean PR_Q / PR_K over steps >= first_step."""
    import numpy as np
    from stats_fixtures import collapse_curve

    steps = [s for s in info["steps"] if s >= first_step]
    p = np.array(steps) / info["max_steps"]
    qk = np.array([[collapse_curve(s, info["collapse"][layer], info["max_steps"],
                                   offset=0.1 * seed) for s in steps] for seed in (0, 1)])
    mean = qk.mean(0)  # (steps, 2)
    return float(np.polyfit(p, mean[:, 0], 1)[0]), float(np.polyfit(p, mean[:, 1], 1)[0])


def test_collapse_points_are_found_per_trajectory(collapsing):
    from qkgeom import analysis as A
    from qkgeom.store import open_store

    url, info = collapsing
    with open_store(url, create=False, readonly=True) as store:
        units = A.pr_gap_units(store, "collapse")
        run_units = A.pr_gap_units(store, "collapse", level="run")
    cp = A.collapse_points(units, level="trajectory")
    assert cp.height == 2 * (2 + 3)  # (depth, init, layer) trajectories
    for r in cp.iter_rows(named=True):
        assert r["collapse_step"] == info["collapse"][r["layer"]], r
        assert r["collapse_progress"] == pytest.approx(r["collapse_step"] / 100)
    rcp = A.collapse_points(run_units, level="run")  # each seed's own curve, same point
    assert rcp.height == 2 * cp.height
    assert all(r["collapse_step"] == info["collapse"][r["layer"]] for r in rcp.iter_rows(
        named=True))


@pytest.mark.parametrize("window", ["start", "collapse", "0.5"])
def test_slopes_over_a_window_match_numpy_polyfit(collapsing, window):
    url, info = collapsing
    d = run_json("stats", "slopes", "--db", url, "--from", window)
    assert d["window"] == (0.5 if window == "0.5" else window)
    assert len(d["slopes"]) == 10
    for u in d["slopes"]:
        first = {"start": 0, "collapse": info["collapse"][u["layer"]], "0.5": 50}[window]
        q, k = _np_window_slopes(info, u["depth"], u["init"], u["layer"], first)
        assert u["slope_pr_q"] == pytest.approx(q, rel=1e-9, abs=1e-9)
        assert u["slope_pr_k"] == pytest.approx(k, rel=1e-9, abs=1e-9)
        if window == "collapse":
            assert u["collapse_step"] == first
            assert (u["slope_pr_q"], u["slope_pr_k"]) == (pytest.approx(3.0), pytest.approx(-0.5))
    if window == "start":  # a line from step 0 measures the collapse: PR_Q "falls"
        assert d["pr_q"]["share_positive"] == 0.0
    if window == "collapse":
        assert d["collapse"]["step_min"] == 10 and d["collapse"]["step_max"] == 20


def test_sign_test_window_changes_all_probes_summary(collapsing):
    url, _ = collapsing
    start = run_json("stats", "sign-test", "--db", url, "--summary", "all")
    after = run_json("stats", "sign-test", "--db", url, "--summary", "all", "--from",
                     "collapse")
    # the gap is negative early in the collapse, positive from the collapse point on
    assert (start["n"], start["n_positive"]) == (10, 0)
    assert (after["n"], after["n_positive"]) == (10, 10) and after["window"] == "collapse"
    assert after["p_value"] == 2.0**-10
    final = [run_json("stats", "sign-test", "--db", url, "--from", w)["n_positive"]
             for w in ("start", "collapse", "0.3")]
    assert final == [10, 10, 10]  # the final probe is in every window
    code, out = run("stats", "sign-test", "--db", url, "--summary", "all", "--from", "collapse")
    assert code == 0 and "10 of 10 positive" in out and "collapse points of 10 units" in out
    code, out = run("stats", "slopes", "--db", url, "--from", "collapse", "--level", "run")
    assert code == 0 and "end of the initial collapse" in out


@pytest.mark.parametrize("bad", ["middle", "1.0", "-0.1"])
def test_bad_window_is_one_line_error(collapsing, bad):
    url, _ = collapsing
    for cmd in ("slopes", "sign-test"):
        code, out = run("stats", cmd, "--db", url, "--from", bad)
        assert code != 0 and "--from" in out and "start, collapse" in out
        assert "Traceback" not in out
