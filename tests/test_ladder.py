"""qkgeom.report.ladder: which claims the scale x learning-rate ladder shows to flip, and the
report's 'on the ladder' column, on hand-made cells whose answer is known."""

from __future__ import annotations

import json

import pytest

from qkgeom.report import ladder as L


def cell(label: str, n_embd: int, lr: float, rules: int | None = L.RULES_VERSION,
         **verdicts: str) -> dict:
    c = {"label": label, "scale": {"n_embd": [n_embd], "lr": [lr]},
         "verdicts": {k.replace("_", "-"): v for k, v in verdicts.items()}}
    if rules is not None:
        c["rules_version"] = rules
    return c


H, F, N = "holds", "does not hold", "not enough data"


@pytest.fixture()
def cells(tmp_path):
    # a: flips with the lr at both widths; b: flips with the width at both lrs; c: the
    # same everywhere; d: flips with the lr at 48 and with the width at 3e-3; e: undecided
    data = [cell("e48-lr1e-3", 48, 1e-3, a=H, b=H, c=F, d=H, e=N),
            cell("e48-lr3e-3", 48, 3e-3, a=F, b=H, c=F, d=F, e=N),
            cell("e64-lr1e-3", 64, 1e-3, a=H, b=F, c=F, d=H, e=N),
            cell("e64-lr3e-3", 64, 3e-3, a=F, b=F, c=F, d=H, e=N)]
    p = tmp_path / "ladder.json"
    p.write_text(json.dumps(data))
    return L.load_cells(p)


def test_flips_are_found_along_the_right_factor(cells):
    a = L.robustness(cells, "a")
    assert (a["flips_with_lr_at_n_embd"], a["flips_with_width_at_lr"]) == ([48, 64], [])
    assert a["summary"] == "flips with the learning rate (at n_embd 48, 64)"
    b = L.robustness(cells, "b")
    assert (b["flips_with_lr_at_n_embd"], b["flips_with_width_at_lr"]) == ([], [1e-3, 3e-3])
    assert b["summary"] == "flips with the width (at lr 0.001, 0.003)"
    assert L.robustness(cells, "c")["summary"] == "'does not hold' in all 4 ladder cells"
    d = L.robustness(cells, "d")
    assert (d["flips_with_lr_at_n_embd"], d["flips_with_width_at_lr"]) == ([48], [3e-3])
    assert d["summary"] == ("flips with the learning rate (at n_embd 48) and with the width "
                            "(at lr 0.003)")
    e = L.robustness(cells, "e")
    assert e["summary"] == "undecided on the ladder"
    assert e["cells"] == {c.label: N for c in cells}


def test_only_one_factor(tmp_path):
    p = tmp_path / "l.json"
    p.write_text(json.dumps([cell("x", 64, 1e-3, a=H), cell("y", 64, 3e-3, a=F),
                             cell("z", 96, 1e-3, a=H)]))
    r = L.robustness(L.load_cells(p), "a")
    assert r["summary"] == "flips with the learning rate (at n_embd 64)"
    p.write_text(json.dumps([cell("x", 64, 1e-3, a=H), cell("z", 96, 1e-3, a=F)]))
    assert L.robustness(L.load_cells(p), "a")["summary"] == \
        "flips with the width (at lr 0.001)"


def test_cells_decided_under_retired_rules_are_not_compared(tmp_path):
    p = tmp_path / "l.json"
    # a flip between an old-rules cell and a current one is not a flip of the claim
    p.write_text(json.dumps([cell("x", 64, 1e-3, rules=None, a=H),
                             cell("y", 64, 3e-3, a=F), cell("z", 96, 3e-3, a=F)]))
    cells = L.load_cells(p)
    assert [c.rules_version for c in cells] == [1, L.RULES_VERSION, L.RULES_VERSION]
    r = L.robustness(cells, "a")
    assert r["summary"] == ("'does not hold' in all 2 ladder cells (1 cell(s) decided under "
                            "the retired rules not compared; docs/findings.md)")
    assert r["cells"] == {"y": F, "z": F}
    # a claim whose rule did not change compares across versions
    p.write_text(json.dumps([cell("x", 64, 1e-3, rules=1, **{"2_gap": H}),
                             cell("y", 64, 3e-3, **{"2_gap": F})]))
    assert L.robustness(L.load_cells(p), "2-gap")["summary"] == \
        "flips with the learning rate (at n_embd 64)"
    p.write_text(json.dumps([cell("x", 64, 1e-3, rules=1, a=H)]))
    assert L.robustness(L.load_cells(p), "a")["summary"].startswith(
        "not yet measured on the ladder under the current rules")


def test_no_ladder_file(tmp_path):
    assert L.load_cells(tmp_path / "absent.json") == []
    assert L.robustness([], "2-gap")["summary"] == "not measured on the ladder"


@pytest.mark.parametrize("text", ["{not json", '[{"label": "x"}]',
                                  '[{"label": "x", "scale": {"n_embd": [32, 48], "lr": [0.001]},'
                                  ' "verdicts": {}}]', '{"label": "x"}'])
def test_a_malformed_ladder_file_is_a_clear_error(tmp_path, text):
    from qkgeom.errors import QkgeomError

    p = tmp_path / "ladder.json"
    p.write_text(text)
    with pytest.raises(QkgeomError, match="is not a ladder file.*studies/ladder.py"):
        L.load_cells(p)


def test_the_shipped_ladder_file_reads():
    cells = L.load_cells()
    if not L.LADDER_FILE.is_file():
        pytest.fail("qkgeom/report/ladder.json is missing: write it with studies/ladder.py --json")
    assert cells and all(c.verdicts for c in cells)
    assert len({(c.n_embd, c.lr) for c in cells}) == len(cells)  # one cell per factor pair


def test_report_shows_the_ladder_column(tmp_path, monkeypatch):
    from stats_fixtures import make_synthetic_db

    from qkgeom.report.render import build_report
    from qkgeom.store import open_store

    url = f"sqlite:///{tmp_path / 's.db'}"
    make_synthetic_db(url, sweep="smoke", seeds=5)
    p = tmp_path / "ladder.json"
    p.write_text(json.dumps([cell("x", 64, 1e-3, **{"2_gap": H}),
                             cell("y", 64, 3e-3, **{"2_gap": F})]))
    monkeypatch.setattr(L, "LADDER_FILE", p)
    with open_store(url) as store:
        build_report(store, "smoke", tmp_path / "rep", n_boot=500)
    md = (tmp_path / "rep" / "report.md").read_text()
    row = next(ln for ln in md.splitlines() if ln.startswith("| 2-gap |"))
    assert row.endswith("| flips with the learning rate (at n_embd 64) (docs/findings.md) |")
    assert ("| claim | paper | measured | verdict | the rule's error rate and power | on the "
            "ladder |") in md
    html = (tmp_path / "rep" / "report.html").read_text()
    assert "<th>on the ladder</th>" in html
    js = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert js["ladder"]["2-gap"]["cells"] == {"x": H, "y": F}
    assert js["ladder"]["3"]["summary"] == "undecided on the ladder"
