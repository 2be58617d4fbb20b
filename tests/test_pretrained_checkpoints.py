"""qkgeom's own checkpoints measured like a pretrained family, stored, and analysed.

A real (tiny) training run on the WikiText files writes checkpoints at steps 0, 20 and 40;
``qkgeom probe-pretrained --checkpoints`` stores each as revision ``step_N`` and
``qkgeom stats checkpoint-trend`` reads them back from ``v_pretrained``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import run
from scipy.stats import spearmanr

from qkgeom import pretrained as P


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, wikitext_dir: Path) -> Path:
    from qkgeom.config import preset
    from qkgeom.engine.train import train

    cfg = preset("smoke").with_overrides({"dataset": str(wikitext_dir)})
    out = tmp_path_factory.mktemp("ckpt") / "run"
    train(cfg, None, checkpoint_dir=out)
    return out


def test_checkpoints_found_in_step_order(trained: Path):
    found = P.checkpoint_dirs(trained)
    assert [s for s, _ in found] == [0, 20, 40]
    assert P.checkpoint_dirs(found[1][1]) == [(20, found[1][1])]  # one checkpoint directory


def test_streaming_probe_matches_engine_probe(trained: Path, wikitext_dir: Path):
    """On one batch, the streaming measurement equals qkgeom's own probe of the model."""
    from qkgeom.engine.probe import probe_model

    model, chars, cfg = P.load_checkpoint(trained / "step_0000040")
    t = cfg["block_size"]
    text = (wikitext_dir / "wiki.test.raw").read_text(encoding="utf-8")[:4 * t]
    m = P.measure_gpt(model, chars, text, max_tokens=None, chunk_tokens=4 * t, erank_seqs=4)
    lut = {c: i + 1 for i, c in enumerate(chars)}
    x = torch.tensor([lut.get(c, 0) for c in text]).view(4, t)
    ref = {(li, h, n): v for li, h, n, v in probe_model(model, x)}
    got = {(li, h, n): v for li, h, n, v in m.rows}
    assert set(got) == set(ref)
    for key, v in ref.items():
        # layer 0 agrees to round-off; deeper layers see the fp32 difference between the
        # probe's explicit softmax and the SDPA kernel the measurement runs
        tol = 1e-9 if key[0] == 0 and key[2].startswith("pr_") else 1e-5
        assert got[key] == pytest.approx(v, rel=tol, abs=tol), key


def stored_layer_values(db: str, model: str) -> dict:
    """{(step, layer, metric): value} of a pretrained model's layer-level rows (plain SQL)."""
    from sqlalchemy import create_engine, text

    eng = create_engine(db)
    try:
        with eng.connect() as conn:
            rows = conn.execute(text(
                "SELECT r.step, m.layer, m.metric, m.value FROM pretrained_metrics m "
                "JOIN pretrained_runs r ON r.id = m.run_id WHERE r.model = :m "
                "AND m.head_key = -1"), {"m": model}).all()
    finally:
        eng.dispose()
    return {(st, la, me): v for st, la, me, v in rows}


def test_multi_revision_checkpoint_trend(trained: Path, wikitext_dir: Path, tmp_path: Path):
    db = "sqlite:///" + str(tmp_path / "ckpt.db")
    text = str(wikitext_dir / "wiki.test.raw")
    # registered as a sweep's trial, the way `qkgeom sweep` records checkpoints
    from qkgeom.store import open_store

    store = open_store(db)
    try:
        sid = store.ensure_sweep("tiny", {"preset": "smoke"}, "test")
        tid = store.ensure_trial(sid, "d2-gaussian-none-s0", {}, depth=2, init="gaussian",
                                 arm="none", seed=0)
        for step, d in P.checkpoint_dirs(trained):
            store.add_checkpoint(tid, step, str(d))
    finally:
        store.close()

    code, out = run("probe-pretrained", "--checkpoints", "tiny/d2-gaussian-none-s0",
                    "--db", db, "--text", text, "--max-tokens", "2048", "--quiet")
    assert code == 0, out
    assert out.count("qkgeom:tiny/d2-gaussian-none-s0 @ step_") == 3

    store = open_store(db)
    try:
        df = store.sql("SELECT revision, step, COUNT(*) AS n FROM v_pretrained WHERE model = "
                       ":m GROUP BY revision, step ORDER BY step",
                       {"m": "qkgeom:tiny/d2-gaussian-none-s0"})
        meta = store.sql("SELECT meta FROM pretrained_runs WHERE revision = 'step_40'")
    finally:
        store.close()
    assert df["revision"].to_list() == ["step_0", "step_20", "step_40"]
    assert df["step"].to_list() == [0, 20, 40]
    # 2 layers x (1 + 2 heads) x 9 metrics
    assert df["n"].to_list() == [54, 54, 54]
    m = meta["meta"][0]
    m = json.loads(m) if isinstance(m, str) else m
    assert m["tokens"] == 2048 and m["source"] == "qkgeom"

    code, out = run("stats", "checkpoint-trend", "--db", db, "--model",
                    "qkgeom:tiny/d2-gaussian-none-s0", "--format", "json")
    assert code == 0, out
    d = json.loads(out)
    assert d["n_checkpoints"] == 3 and d["n_layers"] == 2
    assert [r["layer"] for r in d["by_layer"]] == [0, 1]
    # recomputed from the stored rows (plain SQL) with scipy: PR_Q - PR_K per checkpoint,
    # mean over layers for the overall trend; Spearman against the step
    vals = stored_layer_values(db, "qkgeom:tiny/d2-gaussian-none-s0")
    steps = [0, 20, 40]
    gap = {(st, la): vals[st, la, "pr_q"] - vals[st, la, "pr_k"] for st in steps
           for la in (0, 1)}
    mean_gap = [np.mean([gap[st, 0], gap[st, 1]]) for st in steps]
    assert d["steps"] == steps and d["values"] == pytest.approx(mean_gap, rel=1e-12)
    assert d["rho"] == pytest.approx(spearmanr(steps, mean_gap).statistic, rel=1e-12)
    assert d["peak_step"] == steps[int(np.argmax(mean_gap))]
    for r in d["by_layer"]:
        g = [gap[st, r["layer"]] for st in steps]
        assert r["rho"] == pytest.approx(spearmanr(steps, g).statistic, rel=1e-12)
        assert r["peak_step"] == steps[int(np.argmax(g))]
    # the rank-entropy link: qk_erank vs entropy over the 3 checkpoints x 2 layers
    keys = [(st, la) for st in steps for la in (0, 1)]
    link = spearmanr([vals[k + ("qk_erank",)] for k in keys],
                     [vals[k + ("entropy",)] for k in keys]).statistic
    assert d["rank_entropy_link"]["n"] == 6
    assert d["rank_entropy_link"]["rho"] == pytest.approx(link, rel=1e-12)

    # the same checkpoints by directory: a second model id, idempotent on re-run
    for _ in range(2):
        code, out = run("probe-pretrained", "--checkpoints", str(trained), "--db", db,
                        "--text", text, "--max-tokens", "512", "--quiet")
        assert code == 0, out
    store = open_store(db)
    try:
        runs = store.sql("SELECT model, COUNT(*) AS n FROM pretrained_runs GROUP BY model "
                         "ORDER BY model")
    finally:
        store.close()
    assert runs["n"].to_list() == [3, 3]


def test_bad_checkpoint_spec_is_a_user_error(tmp_path: Path):
    db = "sqlite:///" + str(tmp_path / "e.db")
    code, out = run("probe-pretrained", "--checkpoints", "nosweep/notrial", "--db", db,
                    "--text", __file__)
    assert code == 1 and "no checkpoints recorded" in out
    code, out = run("probe-pretrained", "--db", db)
    assert code == 1 and "exactly one of --model" in out
