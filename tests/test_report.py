"""``qkgeom report``: self-contained HTML, markdown twin, and the right verdicts."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner
from stats_fixtures import make_synthetic_db, write_pretrained_family


def invoke(*args: str):
    from qkgeom.cli import main

    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def verdicts(out_dir) -> dict[str, str]:
    data = json.loads((out_dir / "report.json").read_text())
    return {c["key"]: c["verdict"] for c in data["claims"]}


@pytest.fixture(scope="module")
def planted_report(tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("rep")
    url = "sqlite:///" + str(d / "r.db")
    make_synthetic_db(url, sweep="planted", seeds=5)
    write_pretrained_family(url)
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
    assert v == {"2-gap": "holds", "2-slopes": "holds", "3": "holds", "4-shrink": "holds",
                 "4-hold": "holds", "reality-check": "holds", "5": "holds"}


def test_html_is_self_contained(planted_report):
    _, out = planted_report
    html = (out / "report.html").read_text()
    assert "<script" not in html  # static SVG, nothing to load
    assert not re.search(r"""(src|href)=["']https?://""", html)
    assert html.count("<svg") == 3
    assert "does not hold" not in html.split("Verdict rules")[0]
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
    assert v["2-gap"] == "does not hold"
    assert v["4-shrink"] == v["4-hold"] == v["reality-check"] == v["5"] == "not enough data"
    data = json.loads((out / "report.json").read_text())
    shrink = next(c for c in data["claims"] if c["key"] == "4-shrink")
    assert "no intervention arms" in shrink["measured"]
    assert not (out / "fig-intervention.png").exists()


def test_report_shrink_that_does_not_contract(tmp_path):
    url = "sqlite:///" + str(tmp_path / "w.db")
    # the paper's small-run finding: "shrink" raised W_K's PR above the baseline
    make_synthetic_db(url, sweep="weak", seeds=5, depths=(2,), inits=("gaussian",),
                      key_effect={"shrink": 0.3, "hold": 0.5},
                      entropy_effect={"shrink": 0.1, "hold": 0.3})
    out = tmp_path / "rep"
    assert invoke("report", "--db", url, "--out", str(out)).exit_code == 0
    v = verdicts(out)
    assert v["reality-check"] == "does not hold"
    assert v["4-shrink"] == "does not hold"
    assert v["4-hold"] == "holds"


def test_report_too_few_seeds_is_not_enough_data(tmp_path):
    url = "sqlite:///" + str(tmp_path / "f.db")
    make_synthetic_db(url, sweep="few", seeds=3, depths=(2,), inits=("gaussian",))
    out = tmp_path / "rep"
    assert invoke("report", "--db", url, "--out", str(out)).exit_code == 0
    v = verdicts(out)
    assert v["4-shrink"] == v["4-hold"] == "not enough data"
    data = json.loads((out / "report.json").read_text())
    shrink = next(c for c in data["claims"] if c["key"] == "4-shrink")
    assert "3 paired seeds" in shrink["measured"] and "fewer than 5" in shrink["measured"]


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


def test_report_correlation_needs_three_trials(tmp_path):
    # two trials (two seeds, no arms): rho exists but a bootstrap over 2 trials is no CI
    url = "sqlite:///" + str(tmp_path / "two.db")
    make_synthetic_db(url, sweep="two", seeds=2, depths=(2,), inits=("gaussian",), arms=())
    out = tmp_path / "rep"
    assert invoke("report", "--db", url, "--out", str(out)).exit_code == 0
    assert verdicts(out)["3"] == "not enough data"
    data = json.loads((out / "report.json").read_text())
    c3 = next(c for c in data["claims"] if c["key"] == "3")
    assert "over 2 trials" in c3["measured"] and "fewer than 3 trials" in c3["measured"]


def test_report_correlation_rows_per_depth_with_cis(planted_report):
    _, out = planted_report
    md = (out / "report.md").read_text()
    table = md.split("### Correlations across probes and runs", 1)[1].split("###", 1)[0]
    rows = [r.split("|")[1:-1] for r in table.splitlines() if r.startswith("| pr_k | entropy")]
    # overall then depths 2 and 3; every row with its trial count and a CI around rho
    assert [r[2].strip() for r in rows] == ["all", "2", "3"]
    trials = [int(r[3]) for r in rows]
    assert trials[0] == sum(trials[1:]) == 40
    for r in rows:
        lo, rho, hi = float(r[6]), float(r[5]), float(r[7])
        assert lo <= rho <= hi
