"""Weight snapshots and resume checkpoints, named apart; the ``checkpoints`` table tells
the truth after pruning; ``probe-pretrained --checkpoints SWEEP/TRIAL`` measures every
probe step of a finished sweep, read through the storage's filesystem (``file://``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import run
from sweep_fixtures import assert_matches_reference, assert_sweep_complete

from qkgeom.plan.spec import SpecError, build_plan, plan_from, snapshot_every


def test_snapshot_policy():
    assert snapshot_every("all") == 0
    assert snapshot_every("none") is None
    assert snapshot_every("every:40") == 40
    for bad in ("every:0", "every:-20", "every:x", "some", ""):
        with pytest.raises(SpecError, match="snapshot policy"):
            snapshot_every(bad)
    with pytest.raises(SpecError, match="every:30 is not a multiple of probe_every=20"):
        plan_from("smoke", snapshots="every:30")
    p = plan_from("smoke", snapshots="every:40")
    assert p.snapshots == "every:40" and p.spec["snapshots"] == "every:40"  # stored spec
    default = plan_from("smoke")
    assert default.snapshots == "all" and "snapshots" not in default.spec
    assert plan_from("paper").snapshots == "all"
    code, out = run("sweep", "--resume", "--name", "x", "--snapshots", "none")
    assert code != 0 and "part of the stored spec" in out


def test_train_writes_weight_snapshots_apart_from_checkpoints(tmp_path, wikitext_dir):
    from qkgeom import pretrained as P
    from qkgeom.config import preset
    from qkgeom.engine.train import STATE_FILE, train

    cfg = preset("smoke").with_overrides({"dataset": str(wikitext_dir), "max_steps": 100})
    ck, sn = tmp_path / "ck", tmp_path / "sn"
    train(cfg, None, checkpoint_dir=ck, snapshot_dir=sn, snapshot_every=40)
    assert [s for s, _ in P.checkpoint_dirs(ck)] == [0, 20, 40, 60, 80, 100]
    assert [s for s, _ in P.checkpoint_dirs(sn)] == [0, 40, 80, 100]  # and the last step
    for step, d in P.checkpoint_dirs(sn):
        snap = torch.load(d / STATE_FILE, weights_only=False)
        full = torch.load(ck / d.name / STATE_FILE, weights_only=False)
        assert snap["kind"] == "snapshot" and snap["step"] == full["step"] == step
        assert "optimizer" not in snap and "sampler" not in snap
        assert snap["model"].keys() == full["model"].keys()
        for k, v in full["model"].items():
            assert torch.equal(snap["model"][k], v), (step, k)
        if step > 0:  # AdamW keeps two moments per weight: a snapshot is about a third
            assert (d / STATE_FILE).stat().st_size < 0.5 * (ck / d.name / STATE_FILE).stat().st_size
    # read back through pyarrow.fs from a file:// URI: the step-40 weights
    model, chars, c = P.load_checkpoint(f"file://{sn}/step_0000040")
    ref = torch.load(ck / "step_0000040" / STATE_FILE, weights_only=False)
    assert c == ref["config"] and chars == ref["chars"]
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref["model"][k]), k
    assert [s for s, _ in P.checkpoint_dirs(f"file://{sn}")] == [0, 40, 80, 100]


def _local(loc: str) -> Path:
    assert loc.startswith("file://"), loc  # the sweep's storage was a URI
    return Path(loc[len("file://"):])


@pytest.mark.ray
def test_pruned_sweep_rows_exist_and_every_snapshot_is_probed(scratch, wikitext_dir):  # noqa: F811
    import pyarrow.fs as pafs

    from qkgeom.store import open_store
    from qkgeom.sweeps.driver import SweepOptions, run_sweep, shutdown

    # every trial fails once at step 70 and resumes from a resume checkpoint; with a prune
    # age of 0 every superseded checkpoint but the newest two goes at once
    spec = {"name": "pruned",
            "trial": {"preset": "smoke", "overrides": {"max_steps": 120, "fail_at_step": 70}},
            "grid": {"depths": [1, 2], "inits": ["gaussian"], "seeds": [0]}}
    plan = build_plan(spec, data=str(wikitext_dir))
    db = f"sqlite:///{scratch}/pruned.db"
    try:
        summary = run_sweep(plan, SweepOptions(
            db_url=db, storage=f"file://{scratch}/ray", max_failures=1, prune_age_s=0.0,
            quiet=True, ray_temp_dir=str(scratch / "r")))
    finally:
        shutdown()
    assert summary["errors"] == 0, summary
    assert_sweep_complete(db, "pruned", plan)
    assert assert_matches_reference(db, "pruned") == len(plan.trials)  # resumed exactly

    probe_steps = [0, 20, 40, 60, 80, 100, 120]
    with open_store(db) as store:
        rows = store.sql(
            "SELECT t.trial_key, c.kind, c.step, c.location FROM checkpoints c JOIN trials t "
            "ON t.id = c.trial_id ORDER BY t.trial_key, c.kind, c.step")
    by: dict[tuple[str, str], list[tuple[int, str]]] = {}
    for key, kind, step, loc in rows.iter_rows():
        by.setdefault((key, kind), []).append((step, loc))
        # every row names saved state that exists, as a file and through pyarrow.fs
        assert (_local(loc) / "state.pt").is_file(), (key, kind, step, loc)
        fs, path = pafs.FileSystem.from_uri(loc)
        assert fs.get_file_info(path + "/state.pt").type == pafs.FileType.File
    for t in plan.trials:
        snaps = by[(t.key, "snapshot")]
        assert [s for s, _ in snaps] == probe_steps
        assert all(f"/snapshots/step_{s:07d}" in loc for s, loc in snaps)
        # pruning ran: of the 8 resume checkpoints (0..60, then 80..120 after the retry)
        # the newest two remain, and exactly those are on disk
        resume = by[(t.key, "resume")]
        assert [s for s, _ in resume] == [100, 120], resume
        trial_dir = _local(snaps[0][1]).parent.parent
        on_disk = sorted(str(p) for p in trial_dir.glob("checkpoint_*"))
        assert on_disk == sorted(str(_local(loc)) for _, loc in resume)

    code, out = run("status", "--name", "pruned", "--db", db, "--json")
    assert code == 0 and {r["snapshots"] for r in json.loads(out)} == {len(probe_steps)}

    key = "d1-gaussian-none-s0"
    text = str(wikitext_dir / "wiki.test.raw")
    code, out = run("probe-pretrained", "--checkpoints", f"pruned/{key}", "--db", db,
                    "--text", text, "--max-tokens", "1024", "--quiet")
    assert code == 0, out
    assert out.count(f"qkgeom:pruned/{key} @ step_") == len(probe_steps)
    with open_store(db) as store:
        tid = store.trial_id(store.require_sweep("pruned"), key)
        got = store.sql("SELECT step, layer, value FROM v_pretrained WHERE model = :m AND "
                        "metric = 'pr_wk' AND head IS NULL ORDER BY step, layer",
                        {"m": f"qkgeom:pruned/{key}"})
        ref = store.sql("SELECT step, layer, value FROM probe_metrics WHERE trial_id = :t "
                        "AND metric = 'pr_wk' AND head IS NULL ORDER BY step, layer", {"t": tid})
    # each snapshot holds the weights the trial had at its step: W_K's PR measured from the
    # snapshot equals the one the live trial probed at that step
    assert got.height == ref.height == len(probe_steps)
    for (s1, l1, v1), (s2, l2, v2) in zip(got.iter_rows(), ref.iter_rows()):
        assert (s1, l1) == (s2, l2) and v1 == pytest.approx(v2, rel=1e-6)

    code, out = run("stats", "checkpoint-trend", "--db", db, "--model", f"qkgeom:pruned/{key}",
                    "--format", "json")
    assert code == 0, out
    assert json.loads(out)["n_checkpoints"] == len(probe_steps)
