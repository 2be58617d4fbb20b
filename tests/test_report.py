"""``qkgeom report``: self-contained HTML, markdown twin, and the right verdicts."""

from __future__ import annotations

import json
import re

import pytest
from helpers import invoke
from stats_fixtures import make_synthetic_db, write_pretrained_family


def verdicts(out_dir) -> dict[str, str]:
    data = json.loads((out_dir / "report.json").read_text())
    return {c["key"]: c["verdict"] for c in data["claims"]}


@pytest.fixture(scope="module")
def planted_report(tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("rep")
    url = "sqlite:///" + str(d / "r.db")
    # six seeds: the two arms sharing a baseline are a family that 2^-n < 0.05 / 2 needs
    make_synthetic_db(url, sweep="planted", seeds=6, link=1.0)
    # four layers: the link's layer permutation can reach 1/24 < 0.05 (three: 1/6)
    write_pretrained_family(url, n_layers=4)
    write_pretrained_family(url, "synthetic/other", n_layers=4)
    out = d / "report"
    r = invoke("report", "--db", url, "--out", str(out))
    assert r.exit_code == 0, r.output
    return url, out


def test_report_files_and_verdicts(planted_report):
    _, out = planted_report
    for name in ("report.html", "report.md", "report.json", "fig-trajectories.png",
                 "fig-intervention.png", "fig-correlation.png"):
        assert (out / name).stat().st_size > 500, name
    v = verdicts(out)
    assert v == {"2-gap": "holds", "2-slopes": "holds", "2-slopes-late": "holds", "3": "holds",
                 "4-shrink": "holds", "4-hold": "holds", "reality-check": "holds", "5": "holds"}


def test_html_is_self_contained(planted_report):
    _, out = planted_report
    html = (out / "report.html").read_text()
    assert "<script" not in html  # static SVG, nothing to load
    assert not re.search(r"""(src|href)=["']https?://""", html)
    assert html.count("<svg") == 3
    head = html.split("Verdict rules")[0]
    assert "class='v-does'" not in head and head.count("class='v-holds'") == 8
    assert "15 of 15 trajectories positive" in html


def test_markdown_twin_links_pngs(planted_report):
    _, out = planted_report
    md = (out / "report.md").read_text()
    for link in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md):
        assert (out / link).exists()
    assert "| 4-shrink |" in md and "**holds**" in md


def test_same_seed_same_report(planted_report, tmp_path):
    url, out = planted_report
    again = tmp_path / "again"
    assert invoke("report", "--db", url, "--out", str(again)).exit_code == 0
    for name in ("report.html", "report.md", "report.json"):
        assert (out / name).read_bytes() == (again / name).read_bytes(), name


def test_report_negative_and_missing_data(tmp_path):
    url = "sqlite:///" + str(tmp_path / "n.db")
    # PR_Q < PR_K, no intervention arms, no pretrained models
    make_synthetic_db(url, sweep="neg", pr_gap=-1.0, seeds=3, depths=(2,),
                      inits=("gaussian", "tied"), arms=())
    out = tmp_path / "rep"
    r = invoke("report", "--db", url, "--out", str(out))
    assert r.exit_code == 0, r.output
    v = verdicts(out)
    # every trajectory negative, but 3 seeds cannot reach 5% either way (2^-3 = 0.125)
    assert v["2-gap"] == "not enough data"
    assert v["4-shrink"] == v["4-hold"] == v["reality-check"] == v["5"] == "not enough data"
    data = json.loads((out / "report.json").read_text())
    shrink = next(c for c in data["claims"] if c["key"] == "4-shrink")
    assert "no intervention arms" in shrink["measured"]
    assert not (out / "fig-intervention.png").exists()


def test_report_shrink_that_does_not_contract(tmp_path):
    url = "sqlite:///" + str(tmp_path / "w.db")
    # the paper's small-run finding: "shrink" raised W_K's PR above the baseline
    make_synthetic_db(url, sweep="weak", seeds=6, depths=(2,), inits=("gaussian",),
                      key_effect={"shrink": 0.3, "hold": 0.5},
                      entropy_effect={"shrink": 0.1, "hold": 0.3})
    out = tmp_path / "rep"
    assert invoke("report", "--db", url, "--out", str(out)).exit_code == 0
    v = verdicts(out)
    # W_K PR above the baseline in all 6 seeds: the arm did the opposite of its name
    assert v["reality-check"] == "contradicted"
    # entropy up by 0.1 in all 6 (the opposite of shrink's prediction): Holm 2/64
    assert v["4-shrink"] == "contradicted"
    # hold's entropy is up in all 6 seeds, but it is a secondary arm and the primary
    # (shrink) did not hold: the fixed sequence does not test it
    assert v["4-hold"] == "not shown"
    hold = next(c for c in json.loads((out / "report.json").read_text())["claims"]
                if c["key"] == "4-hold")
    assert "not tested, the primary did not hold" in hold["measured"]


def test_report_too_few_seeds_is_not_enough_data(tmp_path):
    url = "sqlite:///" + str(tmp_path / "f.db")
    make_synthetic_db(url, sweep="few", seeds=3, depths=(2,), inits=("gaussian",))
    out = tmp_path / "rep"
    assert invoke("report", "--db", url, "--out", str(out)).exit_code == 0
    v = verdicts(out)
    assert v["4-shrink"] == v["4-hold"] == "not enough data"
    data = json.loads((out / "report.json").read_text())
    shrink = next(c for c in data["claims"] if c["key"] == "4-shrink")
    assert "3 paired seeds" in shrink["measured"]
    assert "the primary arm needs >= 5 paired seeds" in shrink["measured"]


def test_report_out_is_a_file(tmp_path, planted_report):
    url, _ = planted_report
    f = tmp_path / "file"
    f.write_text("x")
    r = invoke("report", "--db", url, "--out", str(f))
    assert r.exit_code != 0


def test_report_and_plot_json_output(planted_report, tmp_path):
    url, _ = planted_report
    r = invoke("report", "--db", url, "--out", str(tmp_path / "r"), "--format", "json")
    d = json.loads(r.output)
    assert d["verdicts"]["2-gap"] == "holds" and len(d["files"]) == 6
    r = invoke("plot", "trajectories", "--db", url, "--out", str(tmp_path / "t.svg"),
               "--format", "json")
    assert json.loads(r.output)["out"].endswith("t.svg")
    r = invoke("report", "--db", url, "--out", str(tmp_path / "r2"))
    assert "4-shrink" in r.output and "holds" in r.output


def test_report_correlation_needs_enough_trials(tmp_path):
    # two trials (two seeds, no arms): two orders, the smallest permutation p is 1/2
    url = "sqlite:///" + str(tmp_path / "two.db")
    make_synthetic_db(url, sweep="two", seeds=2, depths=(2,), inits=("gaussian",), arms=())
    out = tmp_path / "rep"
    assert invoke("report", "--db", url, "--out", str(out)).exit_code == 0
    assert verdicts(out)["3"] == "not enough data"
    data = json.loads((out / "report.json").read_text())
    c3 = next(c for c in data["claims"] if c["key"] == "3")
    assert "too few baseline trials" in c3["measured"]


def test_report_correlation_rows_the_verdict_pooled_and_arms(planted_report):
    _, out = planted_report
    md = (out / "report.md").read_text()
    table = md.split("### Correlations: across trials at the same training progress", 1)[1].split("###", 1)[0]
    rows = [[c.strip() for c in r.split("|")[1:-1]] for r in table.splitlines()
            if r.startswith("| pr_k | entropy")]
    # the verdict's row (baseline, within strata), the pooled baseline row, one per arm
    assert [r[2] for r in rows] == ["none (the verdict)", "none", "hold", "shrink"]
    assert int(rows[0][4]) == 36 and float(rows[0][6]) < 0.05  # 2 depths x 3 inits x 6
    lo, rho, hi = float(rows[1][7]), float(rows[1][5]), float(rows[1][8])
    assert lo <= rho <= hi
    data = json.loads((out / "report.json").read_text())
    c3 = next(c for c in data["claims"] if c["key"] == "3")
    assert "matched-progress Spearman(entropy, pr_k)" in c3["measured"]


def test_report_states_its_scale_and_optimiser_beside_the_papers(tmp_path):
    from qkgeom.config import preset
    from qkgeom.store import open_store

    url = "sqlite:///" + str(tmp_path / "s.db")
    make_synthetic_db(url, sweep="scaled", seeds=5, depths=(2,), inits=("gaussian",))
    cpu = preset("cpu").to_dict()
    with open_store(url) as store:  # give the trials real configs (the cpu preset's)
        sid = store.sweep_id("scaled")
        for r in store.trials("scaled").iter_rows(named=True):
            cfg = dict(cpu, n_layer=r["depth"], init=r["init"], arm=r["arm"], seed=r["seed"])
            store.ensure_trial(sid, r["trial_key"], cfg, depth=r["depth"], init=r["init"],
                               arm=r["arm"], seed=r["seed"])
    out = tmp_path / "rep"
    assert invoke("report", "--db", url, "--out", str(out)).exit_code == 0
    md = (out / "report.md").read_text()
    header = md.split("## Scale and optimiser, beside the paper's", 1)[1].split("## Claims", 1)[0]
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:4]]
            for r in header.splitlines() if r.startswith("| ") and "---" not in r}
    assert rows["width n_embd"] == ["48", "256 (reconstructed)"]
    assert rows["context"][0] == "48" and rows["training steps"][0] == "1500"
    assert rows["peak lr"][0] == "0.0010" and rows["lr floor (cosine)"][0] == "1.000e-04"
    assert rows["warm-up steps"][0] == "60" and "200" in rows["warm-up steps"][1]
    assert rows["AdamW betas"][0] == "(0.9, 0.99)" and rows["weight decay"][0] == "0.1"
    assert rows["grid seeds"][0] == "0, 1, 2, 3, 4"
    assert rows["seeds of arm shrink"][0] == "5 (0, 1, 2, 3, 4)"
    assert "docs/findings.md" in header
    scale = json.loads((out / "report.json").read_text())["scale"]
    assert scale["lr"] == [0.001] and scale["n_embd"] == [48]


def test_report_shrink_act_arm_and_the_job_table(tmp_path):
    url = "sqlite:///" + str(tmp_path / "a.db")
    make_synthetic_db(url, sweep="act", seeds=6, depths=(2,), inits=("gaussian",),
                      arms=("hold", "shrink", "shrink_act"),
                      key_effect={"shrink": -0.4, "hold": 0.4, "shrink_act": -0.5},
                      entropy_effect={"shrink": -0.3, "hold": 0.3, "shrink_act": -0.2})
    out = tmp_path / "rep"
    assert invoke("report", "--db", url, "--out", str(out)).exit_code == 0
    v = verdicts(out)
    assert v["4-shrink_act"] == v["reality-check-act"] == v["reality-check"] == "holds"
    data = json.loads((out / "report.json").read_text())
    act = next(c for c in data["claims"] if c["key"] == "4-shrink_act")
    assert "achieved: W_K PR" in act["measured"] and "lower in 6 of 6" in act["measured"]
    md = (out / "report.md").read_text()
    job = md.split("### Did each arm do its job?", 1)[1].split("###", 1)[0]
    lines = [r for r in job.splitlines() if r.startswith("| ")]
    assert "entropy verdict" in lines[0] and "key PR_K: arm vs baseline" in lines[0]
    by_arm = {r.split("|")[1].strip(): r for r in lines[1:]}
    assert set(by_arm) == {"shrink", "hold", "shrink_act"}
    assert "lower in 6 of 6" in by_arm["shrink"] and "lower in 0 of 6" in by_arm["hold"]
    # a sweep without shrink_act has no shrink_act claims
    assert "4-shrink_act" not in verdicts(_planted_out(tmp_path))


def _planted_out(tmp_path):
    url = "sqlite:///" + str(tmp_path / "p.db")
    make_synthetic_db(url, sweep="p", seeds=5, depths=(2,), inits=("gaussian",))
    out = tmp_path / "prep"
    assert invoke("report", "--db", url, "--out", str(out)).exit_code == 0
    return out


def test_report_shows_both_trend_windows(planted_report):
    _, out = planted_report
    md = (out / "report.md").read_text()
    sec = md.split("### Trends from step 0 and from progress 0.25", 1)[1]
    sec = sec.split("###", 1)[0]
    assert "| statistic | paper | from step 0 | from progress 0.25 |" in sec
    assert "about +0.14" in sec and "fixed before the data are seen" in sec
    data = json.loads((out / "report.json").read_text())
    c = next(c for c in data["claims"] if c["key"] == "2-slopes-late")
    assert c["numbers"]["window"] == "late" and c["verdict"] == "holds"


def test_the_header_counts_grid_seeds_apart_from_the_arms_extra_baselines(tmp_path):
    """The cpu study's design: grid seeds 0, 1 at every (depth, init); the arms' baselines
    add seeds 2-4 at depth 4, gaussian only. Those are not grid seeds."""
    from stats_fixtures import write_trials

    from qkgeom.analysis.trials import grid_seed_list, study_scale
    from qkgeom.store import open_store

    flat = lambda step, layer: {"pr_q": 5.0, "pr_k": 4.0}  # noqa: E731
    grid = [dict(depth=d, init=i, arm="none", seed=s, values=flat)
            for d in (2, 4) for i in ("gaussian", "tied") for s in (0, 1)]
    extra = [dict(depth=4, init="gaussian", arm=a, seed=s, values=flat)
             for s in (2, 3, 4) for a in ("none",)] + [
        dict(depth=4, init="gaussian", arm="shrink", seed=s, values=flat) for s in range(5)]
    url = "sqlite:///" + str(tmp_path / "g.db")
    write_trials(url, "g", grid + extra, steps=[0, 10], max_steps=10)
    with open_store(url, create=False, readonly=True) as store:
        sc = study_scale(store, "g")
    assert sc["grid_seeds"] == [0, 1]
    assert sc["arm_seeds"] == {"shrink": [0, 1, 2, 3, 4]}
    assert grid_seed_list([]) == []
    assert grid_seed_list([(0, 2, "t"), (1, 2, "t"), (1, 3, "t")]) == [1]
