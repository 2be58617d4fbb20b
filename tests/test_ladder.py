"""The ladder and comparisons from the database: ``qkgeom report --ladder SWEEP[@DB]`` (the
column 'on the ladder' decided from a ladder sweep's cells under this qkgeom's rules) and
``--compare SWEEP[@DB]`` (sweeps of one or several databases as cells of one report, with
the cells-at-a-glance and seed-stability tables), on synthetic sweeps whose answers are
known by hand; the databases read are never changed."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
from helpers import invoke

from qkgeom.records import ProbeRecord
from qkgeom.report.claims import CONTRADICTED, HOLDS, NO_DATA

STEPS = [0, 50, 100]
INITS = ("gaussian", "tied", "orthogonal")
SEEDS = (0, 1, 2, 3, 4)  # 2-gap needs 5 seeds (its unit) to reach p < 0.05


def plant(url: str, sweep: str, cells: dict[str | None, tuple[dict, float]]) -> None:
    """A sweep whose cells have config ``factors`` and PR_Q - PR_K = ``gap`` (+ 0.01 x seed
    on PR_Q) in every layer and probe; cell None: a sweep without cells."""
    from qkgeom.store import open_store

    with open_store(url) as store:
        sid = store.ensure_sweep(sweep, {"synthetic": True}, "synthetic")
        for cell, (factors, gap) in cells.items():
            for init in INITS:
                for seed in SEEDS:
                    cfg = {**factors, "max_steps": 100, "n_layer": 2, "init": init,
                           "seed": seed}
                    key = f"{cell or 'c'}.d2-{init}-none-s{seed}"
                    tid = store.ensure_trial(sid, key, cfg, depth=2, init=init, arm="none",
                                             seed=seed, cell=cell)
                    recs = [ProbeRecord(step=s, progress=s / 100, tokens=s,
                                        train_loss=float("nan"), val_loss=1.0, lr=1e-3,
                                        tokens_per_s=0.0,
                                        metrics=[m for layer in range(2) for m in (
                                            (layer, None, "pr_q", 5.0 + gap + 0.01 * seed),
                                            (layer, None, "pr_k", 5.0))]) for s in STEPS]
                    store.write_probes(tid, recs)
                    store.set_trial_status(tid, "running", bump_attempts=True)
                    store.set_trial_result(tid, test_loss=2.0 + 0.1 * seed)
                    store.set_trial_status(tid, "terminated")


@pytest.fixture(scope="module")
def dbs(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("ladder")
    lad, cpu = f"sqlite:///{d / 'ladder.db'}", f"sqlite:///{d / 'cpu.db'}"
    plant(lad, "ladder", {"e48": ({"n_embd": 48, "lr": 1e-3}, 1.0),
                          "e64": ({"n_embd": 64, "lr": 1e-3}, -1.0)})
    plant(cpu, "cpu", {None: ({"n_embd": 48, "lr": 1e-3}, 1.0)})
    return {"ladder": lad, "cpu": cpu}


def digest(url: str) -> str:
    return hashlib.sha256(Path(url.removeprefix("sqlite:///")).read_bytes()).hexdigest()


def report(tmp_path: Path, db: str, *extra: str) -> tuple[dict, str]:
    out = tmp_path / "rep"
    r = invoke("report", "--db", db, "--out", str(out), "--boot", "200", *extra)
    assert r.exit_code == 0, r.output
    return (json.loads((out / "report.json").read_text()),
            (out / "report.md").read_text(encoding="utf-8"))


def test_the_ladder_column_is_decided_from_the_ladder_sweep(dbs, tmp_path):
    before = {k: digest(u) for k, u in dbs.items()}
    js, md = report(tmp_path, dbs["cpu"], "--sweep", "cpu", "--ladder",
                    f"ladder@{dbs['ladder'].removeprefix('sqlite:///')}")
    gap = js["ladder"]["2-gap"]
    # the report's own sweep is a cell of the column; +1 gap holds, -1 does not
    assert gap["cells"] == {"cpu": HOLDS, "e48": HOLDS, "e64": CONTRADICTED}
    assert gap["summary"] == ("holds in 2 of 3 cells; flips with n_embd "
                              "(48 -> 64: holds -> contradicted)")
    assert "| on the ladder (this sweep, ladder) |" in md
    row = next(ln for ln in md.splitlines() if ln.startswith("| 2-gap |"))
    assert row.endswith("| holds in 2 of 3 cells; flips with n_embd (48 -> 64: holds -> "
                        "contradicted) |")
    verdicts = {c["key"]: c["verdict"] for c in js["claims"]}
    assert verdicts["2-gap"] == HOLDS  # the report's own verdict is its sweep's
    assert {k: digest(u) for k, u in dbs.items()} == before


def test_the_ladder_column_names_the_width_where_the_reported_sweep_differs(dbs, tmp_path):
    """A wider sweep reported beside the ladder (issue 26's 128/128 grid beside the six
    cells): the flip to the report's own cell is named, with the widths either side."""
    wide = f"sqlite:///{tmp_path / 'wide.db'}"
    plant(wide, "wide", {None: ({"n_embd": 128, "lr": 1e-3}, 1.0)})
    js, md = report(tmp_path, wide, "--sweep", "wide", "--ladder", f"ladder@{dbs['ladder']}")
    gap = js["ladder"]["2-gap"]
    assert gap["cells"] == {"wide": HOLDS, "e48": HOLDS, "e64": CONTRADICTED}
    assert gap["summary"] == ("holds in 2 of 3 cells; flips with n_embd (48 -> 64: holds -> "
                              "contradicted; 64 -> 128: contradicted -> holds)")
    js, _ = report(tmp_path, dbs["ladder"], "--sweep", "ladder", "--where", "cell=e64",
                   "--ladder", "ladder")  # a cell of the ladder itself is not counted twice
    assert js["ladder"]["2-gap"]["cells"] == {"e48": HOLDS, "e64": CONTRADICTED}


def test_without_a_ladder_the_column_says_how_to_get_one(dbs, tmp_path):
    js, md = report(tmp_path, dbs["cpu"], "--sweep", "cpu")
    assert js["ladder"] == {}
    assert "| on the ladder (--ladder SWEEP) |" in md
    assert not list(Path(__file__).resolve().parents[1].joinpath("qkgeom").rglob(
        "ladder.json"))  # no file of past verdicts in the package


def test_sweeps_of_two_databases_compared_as_cells(dbs, tmp_path):
    before = {k: digest(u) for k, u in dbs.items()}
    js, md = report(tmp_path, dbs["cpu"], "--sweep", "cpu", "--compare",
                    f"ladder@{dbs['ladder']}")
    cells = {c["label"]: {k["key"]: k["verdict"] for k in c["claims"]} for c in js["cells"]}
    assert list(cells) == ["cpu", "ladder/e48", "ladder/e64"]
    assert [cells[c]["2-gap"] for c in cells] == [HOLDS, HOLDS, CONTRADICTED]
    assert [f["name"] for f in js["factors"]] == ["n_embd"]
    sens = next(r for r in js["sensitivity"] if r["claim"] == "2-gap")
    assert sens["n_embd"].startswith("flips")
    g = js["glance"]
    # 3 inits x 2 layers per seed, every unit positive (+1) or negative (-1)
    assert g["cpu"]["gap_per_seed"] == {str(s): [6, 6] for s in SEEDS}
    assert g["ladder/e64"]["gap_per_seed"] == {str(s): [0, 6] for s in SEEDS}
    last = g["cpu"]["last_layer"]["2"]  # PR_Q = 6 + 0.01 seed: mean 6.02 over seeds 0-4
    assert last["pr_q"] == pytest.approx(6.02) and last["pr_k"] == pytest.approx(5.0)
    assert (last["q_gt_k"], last["n"]) == (15, 15)
    assert g["cpu"]["test_loss"]["none"] == pytest.approx(2.2)  # 2.0 + 0.1 x mean seed
    assert g["cpu"]["trials"] == g["cpu"]["terminated"] == 15
    # one seed alone is one unit of 2-gap: not enough data, however many layers agree
    assert {s: v["2-gap"] for s, v in g["cpu"]["per_seed"].items()} == {
        str(s): NO_DATA for s in SEEDS}
    assert "## Cells at a glance" in md and "## Seed stability" in md
    # seed stability, 2-gap first: seed 0 / ... / seed 4 / all (one seed: not enough data)
    lines = md.splitlines()
    assert any(ln.startswith("| cpu | ? / ? / ? / ? / ? / holds |") for ln in lines)
    # e64: one seed alone cannot reach 5% either way; all five negative: contradicted
    assert any(ln.startswith("| ladder/e64 | ? / ? / ? / ? / ? / contra |") for ln in lines)
    assert js["sweep"] == "cpu vs ladder"
    assert (tmp_path / "rep" / "fig-final-gap.png").stat().st_size > 1000  # faceted by cell
    assert "![PR_Q - PR_K at the last probe per layer, one panel per cell" in md
    assert {k: digest(u) for k, u in dbs.items()} == before


def test_sweeps_of_one_database_compared_and_filtered(dbs, tmp_path):
    src = dbs["ladder"].removeprefix("sqlite:///")
    one = f"sqlite:///{tmp_path / 'one.db'}"
    assert invoke("db", "merge", "--from", src, "--db", one).exit_code == 0
    assert invoke("db", "merge", "--from", dbs["cpu"], "--db", one).exit_code == 0
    js, _ = report(tmp_path, one, "--sweep", "cpu", "--compare", "ladder", "--seeds", "0")
    cells = {c["label"]: {k["key"]: k["verdict"] for k in c["claims"]} for c in js["cells"]}
    assert [cells[c]["2-gap"] for c in cells] == [NO_DATA, NO_DATA, NO_DATA]  # one seed
    assert js["glance"]["cpu"]["gap_per_seed"] == {"0": [6, 6]}  # --seeds applies to all
    assert js["where"] == "seeds 0"


@pytest.mark.parametrize("extra, message", [
    (("--compare", "cpu"), "sweep 'cpu' is named twice in the comparison"),
    (("--compare", "nope@LADDER"), "no sweep named 'nope'"),
    (("--ladder", "ladder@"), "expected SWEEP or SWEEP@DB"),
    (("--compare", "ladder@LADDER", "--where", "n_emb=48"), "has no factor 'n_emb'"),
])
def test_bad_comparisons_are_refused_in_one_line(dbs, tmp_path, extra, message):
    before = {k: digest(u) for k, u in dbs.items()}
    extra = tuple(e.replace("LADDER", dbs["ladder"]) for e in extra)
    r = invoke("report", "--db", dbs["cpu"], "--sweep", "cpu", "--out", str(tmp_path / "r"),
               *extra)
    assert r.exit_code != 0 and message in r.output, r.output
    assert "Traceback" not in r.output
    assert {k: digest(u) for k, u in dbs.items()} == before


def test_open_study_exposes_the_factors_and_facets_a_chart(dbs, tmp_path):
    import polars as pl

    import qkgeom
    from qkgeom.errors import QkgeomError
    from qkgeom.report import plots

    with qkgeom.open_study(dbs["ladder"], "ladder") as st:
        assert st.factors() == ["n_embd"]  # lr is the same in both cells
        cells = st.cells()
        assert cells.select("cell", "n_embd", "n_trials", "terminated").rows() == [
            ("e48", 48, 15, 15), ("e64", 64, 15, 15)]
        t = st.trials()
        assert t.columns[:3] == ["trial_id", "cell", "n_embd"]
        assert t.group_by("n_embd").len().sort("n_embd").rows() == [(48, 15), (64, 15)]
        gap = st.gap_frame()
        means = gap.group_by("n_embd").agg(pl.col("value").mean()).sort("n_embd").rows()
        assert means == [(48, pytest.approx(1.02)), (64, pytest.approx(-0.98))]
        path = plots.save_chart(st.chart("final-gap"), tmp_path / "gap.png")
        assert path.stat().st_size > 1000
        with pytest.raises(QkgeomError, match="has the factors n_embd, cell"):
            st.chart("final-gap", facet="lr")
    with qkgeom.open_study(dbs["cpu"], "cpu") as st:  # no cells: frames as before
        assert st.factors() == [] and "cell" not in st.trials().columns
        assert st.cells()["cell"].to_list() == [None]
        with pytest.raises(QkgeomError, match="no cells to facet by"):
            st.chart("final-gap")


def test_the_live_page_groups_and_filters_by_factor(dbs):
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from qkgeom.web.serve import create_app

    before = digest(dbs["ladder"])
    with TestClient(create_app(dbs["ladder"], n_boot=200, wait_s=60, update_every_s=0),
                    base_url="http://127.0.0.1") as c:
        page = c.get("/sweeps/ladder?refresh=0").text
        assert "<h2>By factor</h2>" in page and "grouped by n_embd" in page
        table = page[page.index("id='by-factor'"):]
        table = table[:table.index("</table>")]
        # per width: 15 trials; the gap is +1.02 (mean over seeds) at 48, -0.98 at 64
        assert re.search(r"<td[^>]*>48</td><td[^>]*>15</td><td[^>]*>15</td>", table), table
        assert "30 of 30" in table and "0 of 30" in table  # (trial, layer) units per width
        assert "<figure id='factor-chart'><svg" in page
        assert page.count("<th><a href") == 15  # the trial table gains a cell column (and has code)
        one = c.get("/sweeps/ladder?refresh=0&f.n_embd=64&group=cell").text
        trials = one[one.index("id='trials'"):]
        assert trials.count("e64.d2-") == 15 and "e48.d2-" not in trials
        assert "Shown: n_embd=64, grouped by cell" in one
        # the trajectories chart and its downloads follow the filter: PR_Q is 5 - 1 + 0.01
        # x seed in cell e64, so 4.02 as the mean of seeds 0-4 (5.02 over both cells)
        assert "the trials with n_embd = 64" in one and "<figure id='chart'><svg" in one
        assert "trajectories.csv?metric=pr_q%2Cpr_k&amp;view=mean&amp;f.n_embd=64" in one
        import io

        import polars as pl

        def csv(q: str) -> pl.DataFrame:
            r = c.get(f"/sweeps/ladder/trajectories.csv?{q}")
            assert r.status_code == 200, r.text
            return pl.read_csv(io.BytesIO(r.content))

        mean64 = csv("metric=pr_q&f.n_embd=64")
        assert mean64.height == 3 * 2 * 3  # init x layer x step
        assert mean64["value"].to_list() == pytest.approx([4.02] * 18)
        assert csv("metric=pr_q")["value"].to_list() == pytest.approx([5.02] * 18)
        runs = csv("metric=pr_q&view=trial&f.cell=e48")
        assert runs["trial_id"].n_unique() == 15 and set(runs["n_embd"]) == {48}
        svg = c.get("/sweeps/ladder/chart.svg?f.n_embd=64")
        assert svg.status_code == 200 and svg.text.lstrip().startswith("<svg")
        assert c.get("/sweeps/ladder/trajectories.csv?f.width=64").status_code == 400
        bad = c.get("/sweeps/ladder?f.n_emb=64")
        assert bad.status_code == 400 and "&#x27;n_emb&#x27; is not a factor" in bad.text
        bad = c.get("/sweeps/ladder?group=seedz")
        assert bad.status_code == 400 and "factors: n_embd, cell" in bad.text
    assert digest(dbs["ladder"]) == before


def test_plot_final_gap_by_a_factor_from_the_cli(dbs, tmp_path):
    from helpers import run

    code, out = run("plot", "final-gap", "--db", dbs["ladder"], "--sweep", "ladder",
                    "--out", str(tmp_path / "g.json"), "--where", "n_embd=64")
    assert code == 0, out
    spec = json.loads((tmp_path / "g.json").read_text())
    values = next(iter(spec["datasets"].values()))
    assert {r["n_embd"] for r in values} == {64}  # the filter applies
    assert {round(r["value"], 6) for r in values} == {-0.98}  # mean over seeds 0-4
    code, out = run("plot", "final-gap", "--db", dbs["cpu"], "--sweep", "cpu", "--out",
                    str(tmp_path / "x.png"))
    assert code != 0 and "no cells to facet by" in out


def test_the_live_page_compares_sweeps(dbs, tmp_path):
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from qkgeom.web.serve import create_app

    one = f"sqlite:///{tmp_path / 'one.db'}"
    for src in dbs.values():
        assert invoke("db", "merge", "--from", src, "--db", one).exit_code == 0
    with TestClient(create_app(one, n_boot=200, wait_s=60, update_every_s=0),
                    base_url="http://127.0.0.1") as c:
        index = c.get("/?refresh=0").text
        assert index.count("<input type='checkbox' name='sweep'") == 2
        page = c.get("/compare?sweep=cpu&sweep=ladder").text
        assert "Verdicts by cell (3 cells)" in page and "Sensitivity: claim x factor" in page
        assert "ladder/e64" in page and "Seed stability" in page
        bad = c.get("/compare?sweep=cpu")
        assert bad.status_code == 400 and "two or more sweeps" in bad.text
        bad = c.get("/compare?sweep=cpu&sweep=nope")
        assert bad.status_code == 404
