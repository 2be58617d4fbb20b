"""Charts: real, non-empty images with marks and bounded inline data."""

from __future__ import annotations

import struct

import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner
from stats_fixtures import make_synthetic_db

from qkgeom.report import plots


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _spec_rows(spec: dict) -> int:
    return sum(len(v) for v in spec.get("datasets", {}).values())


def _marks(spec: dict) -> list[str]:
    out = []

    def walk(node):
        if isinstance(node, dict):
            if "mark" in node:
                m = node["mark"]
                out.append(m["type"] if isinstance(m, dict) else m)
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(spec)
    return out


def traj_frame(n_steps: int = 101) -> pl.DataFrame:
    rows = []
    for depth in (2, 3):
        for init in ("gaussian", "tied"):
            for layer in range(depth):
                for s in range(n_steps):
                    p = s / (n_steps - 1)
                    rows.append(dict(depth=depth, init=init, layer=layer, metric="pr_q",
                                     progress=p, value=10 + 3 * p))
                    rows.append(dict(depth=depth, init=init, layer=layer, metric="pr_k",
                                     progress=p, value=9 - p))
    return pl.DataFrame(rows)


def test_trajectories_chart_is_binned_and_drawn(tmp_path):
    chart = plots.trajectories(traj_frame())
    spec = chart.to_dict()
    assert "line" in _marks(spec)
    rows = _spec_rows(spec)
    # 10 layer curves x 2 metrics x 41 progress bins (101 points each, every bin hit)
    assert rows == 10 * 2 * (plots.PROGRESS_BINS + 1)
    # each drawn point is the mean of the input points nearest to its bin centre k / 40,
    # binned here with numpy's digitize on the bin edges (k +- 0.5) / 40
    p = np.arange(101) / 100
    edges = (np.arange(plots.PROGRESS_BINS) + 0.5) / plots.PROGRESS_BINS
    k = np.digitize(p, edges)
    centre = np.arange(plots.PROGRESS_BINS + 1) / plots.PROGRESS_BINS
    want = {"PR_Q": [np.mean(10 + 3 * p[k == b]) for b in range(plots.PROGRESS_BINS + 1)],
            "PR_K": [np.mean(9 - p[k == b]) for b in range(plots.PROGRESS_BINS + 1)]}
    (data,) = spec["datasets"].values()
    curves: dict = {}
    for r in data:
        curves.setdefault((r["depth"], r["init"], r["layer"], r["metric"]), []).append(
            (r["progress"], r["value"]))
    assert len(curves) == 20
    for (_, _, _, metric), pts in curves.items():
        pts.sort()
        assert [x for x, _ in pts] == pytest.approx(centre, abs=1e-12)
        assert [v for _, v in pts] == pytest.approx(want[metric], rel=1e-12)
    path = plots.save_chart(chart, tmp_path / "t.png")
    w, h = png_size(path.read_bytes())
    assert w > 100 and h > 100


def test_intervention_chart(tmp_path):
    rng = np.random.default_rng(0)
    rows = [dict(arm=a, seed=s, progress=p / 10, metric=m, value=float(rng.normal()))
            for a in ("none", "hold", "shrink") for s in range(3) for p in range(11)
            for m in ("entropy", "pr_wk", "pr_k")]
    chart = plots.intervention(pl.DataFrame(rows))
    spec = chart.to_dict()
    assert {"area", "line"} <= set(_marks(spec))
    assert _spec_rows(spec) == 3 * 3 * 11
    for suffix in (".svg", ".html", ".json"):
        p = plots.save_chart(chart, tmp_path / f"i{suffix}")
        assert p.stat().st_size > 1000
    html = (tmp_path / "i.html").read_text()
    # self-contained: vega inlined, no script loaded from a CDN
    assert "<script src=" not in html and "cdn.jsdelivr" not in html
    assert "<svg" in (tmp_path / "i.svg").read_text()


def test_correlation_subsamples_deterministically():
    rng = np.random.default_rng(1)
    n = plots.MAX_POINTS * 2
    df = pl.DataFrame({"pr_k": rng.normal(size=n), "entropy": rng.normal(size=n),
                       "depth": rng.integers(2, 4, n)})
    a = plots.correlation(df, x="pr_k", y="entropy", rho=0.5).to_dict()
    b = plots.correlation(df, x="pr_k", y="entropy", rho=0.5).to_dict()
    assert a == b
    assert _spec_rows(a) == plots.MAX_POINTS
    assert "point" in _marks(a)
    assert f"{plots.MAX_POINTS} of {n}" in str(a["title"])


def test_plot_errors(tmp_path):
    with pytest.raises(plots.PlotError, match="columns"):
        plots.trajectories(pl.DataFrame({"x": [1]}))
    empty = traj_frame(2).with_columns(pl.lit(float("nan")).alias("value"))
    with pytest.raises(plots.PlotError, match="no finite values"):
        plots.trajectories(empty)
    chart = plots.trajectories(traj_frame(3))
    with pytest.raises(plots.PlotError, match=".html, .png"):
        plots.save_chart(chart, tmp_path / "x.gif")
    with pytest.raises(plots.PlotError, match="does not exist"):
        plots.save_chart(chart, tmp_path / "nodir" / "x.png")


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = "sqlite:///" + str(tmp_path_factory.mktemp("plotdb") / "p.db")
    make_synthetic_db(url, sweep="plots", seeds=3)
    return url


@pytest.mark.parametrize("kind", ["trajectories", "intervention", "correlation"])
def test_plot_command_writes_real_png(db, tmp_path, kind):
    from qkgeom.cli import main

    out = tmp_path / f"{kind}.png"
    r = CliRunner().invoke(main, ["plot", kind, "--db", db, "--out", str(out)])
    assert r.exit_code == 0, r.output
    w, h = png_size(out.read_bytes())
    assert w > 100 and h > 100
    assert out.stat().st_size > 5000  # drawn, not a blank canvas


def test_plot_command_vega_json_has_rows(db, tmp_path):
    import json

    from qkgeom.cli import main

    out = tmp_path / "c.json"
    r = CliRunner().invoke(main, ["plot", "correlation", "--db", db, "--out", str(out),
                                  "--x", "qk_erank", "--y", "entropy"])
    assert r.exit_code == 0, r.output
    spec = json.loads(out.read_text())
    assert _spec_rows(spec) > 100 and "point" in _marks(spec)
