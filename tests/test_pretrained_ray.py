"""A checkpoint family fanned out over a real local Ray instance.

A tiny training run writes checkpoints at steps 0, 20 and 40, registered as a sweep's
trial (as ``qkgeom sweep`` records them) plus a corrupt fourth one. ``probe-pretrained
--model qkgeom:SWEEP/TRIAL --ray`` measures the revisions as Ray tasks: the three good ones
are stored (with the same values an in-process measurement gives), the corrupt one is
reported by name; a second run skips every stored revision and starts no task.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import run

from qkgeom import pretrained as P

KEY = "d2-gaussian-none-s0"
MODEL = f"qkgeom:tiny/{KEY}"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, wikitext_dir: Path) -> Path:
    from qkgeom.config import preset
    from qkgeom.engine.train import STATE_FILE, train

    cfg = preset("smoke").with_overrides({"dataset": str(wikitext_dir)})
    out = tmp_path_factory.mktemp("ckpt") / "run"
    train(cfg, None, checkpoint_dir=out)
    bad = out / "step_0000060"
    bad.mkdir()
    (bad / STATE_FILE).write_bytes(b"not a torch checkpoint")
    return out


def _stored(db: str) -> dict[str, tuple]:
    from qkgeom.store import open_store

    store = open_store(db)
    try:
        df = store.sql("SELECT id, revision, created_at FROM pretrained_runs WHERE model = :m",
                       {"m": MODEL})
        rows = store.sql("SELECT r.revision AS revision, m.layer AS layer, m.head_key AS hk, "
                         "m.metric AS metric, m.value AS value FROM pretrained_metrics m "
                         "JOIN pretrained_runs r ON r.id = m.run_id WHERE r.model = :m",
                         {"m": MODEL})
    finally:
        store.close()
    runs = {rev: (rid, str(ts)) for rid, rev, ts in df.iter_rows()}
    vals: dict[str, dict] = {}
    for rev, la, hk, me, v in rows.iter_rows():
        vals.setdefault(rev, {})[(la, None if hk == -1 else hk, me)] = v
    return {"runs": runs, "values": vals}


def test_family_over_local_ray_stores_each_revision_and_rerun_skips(
        trained: Path, wikitext_dir: Path, tmp_path: Path):
    from qkgeom.store import open_store

    db = "sqlite:///" + str(tmp_path / "ray.db")
    text = str(wikitext_dir / "wiki.test.raw")
    store = open_store(db)
    try:
        sid = store.ensure_sweep("tiny", {"preset": "smoke"}, "test")
        tid = store.ensure_trial(sid, KEY, {}, depth=2, init="gaussian", arm="none", seed=0)
        for step, d in P.checkpoint_dirs(trained):
            store.add_checkpoint(tid, step, str(d))
    finally:
        store.close()

    code, out = run("probe-pretrained", "--model", MODEL, "--ray", "--retries", "1",
                    "--db", db, "--text", text, "--max-tokens", "1024")
    assert code == 1, out
    assert "as Ray tasks" in out
    assert "step_60: FAILED" in out and "1 of 4 revision(s) failed" in out
    got = _stored(db)
    assert set(got["runs"]) == {"step_0", "step_20", "step_40"}

    # values: the same as measuring the checkpoint here, in this process
    body = Path(text).read_text(encoding="utf-8")
    job = P.RevisionJob("step_40", 40, "qkgeom", location=str(trained / "step_0000040"))
    ref = {(la, h, n): v for la, h, n, v in
           P.measure_job(job, body, text, max_tokens=1024).rows}
    assert set(got["values"]["step_40"]) == set(ref)
    for k, v in ref.items():
        assert got["values"]["step_40"][k] == pytest.approx(v, rel=1e-9, abs=1e-12), k

    # a rerun of the stored revisions measures nothing and leaves the rows as they were
    code, out = run("probe-pretrained", "--model", MODEL, "--revisions",
                    "step_0,step_20,step_40", "--ray", "--db", db, "--text", text,
                    "--max-tokens", "1024")
    assert code == 0, out
    assert "3 revision(s) already stored, skipped" in out and "Ray tasks" not in out
    assert _stored(db)["runs"] == got["runs"]

    # --force measures them again (new rows, same values)
    code, out = run("probe-pretrained", "--model", MODEL, "--revisions", "step_0,step_40",
                    "--ray", "--force", "--db", db, "--text", text, "--max-tokens", "1024")
    assert code == 0, out
    again = _stored(db)
    assert again["runs"]["step_20"] == got["runs"]["step_20"]
    assert again["runs"]["step_40"][1] != got["runs"]["step_40"][1]
    for k, v in ref.items():
        assert again["values"]["step_40"][k] == pytest.approx(v, rel=1e-9, abs=1e-12), k


def test_unknown_revision_of_own_checkpoints_is_a_user_error(trained: Path, tmp_path: Path):
    code, out = run("probe-pretrained", "--model", f"qkgeom:{trained}", "--revisions",
                    "step_7", "--db", "sqlite:///" + str(tmp_path / "x.db"), "--text", __file__)
    assert code == 1 and "no checkpoint for step_7" in out and "Traceback" not in out
