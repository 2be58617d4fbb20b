"""Writes: idempotent upserts, non-finite round trips, trial status, pretrained runs, and
the views' contents (SQLite and PostgreSQL)."""

from __future__ import annotations

import math
import pickle

import pytest
from helpers import make_record

from qkgeom.errors import QkgeomError
from qkgeom.records import METRICS, ProbeRecord, StepRecord

KEY = ["trial_id", "step", "layer", "head_key", "metric"]


def _trial(store, key="d2-gaussian-none-s0", sweep="s", **kw):
    sid = store.ensure_sweep(sweep, {"grid": [1, 2]}, "v1")
    args = dict(depth=2, init="gaussian", arm="none", seed=0) | kw
    return sid, store.ensure_trial(sid, key, {"n_layer": args["depth"]}, **args)


def _count(store, sql, params=None) -> int:
    return int(store.sql(sql, params).item())


def test_sweep_and_trial_are_idempotent(store):
    sid = store.ensure_sweep("grid", {"a": 1}, "v1")
    assert store.ensure_sweep("grid", {"a": 2}, "v2") == sid
    sw = store.sweeps()
    assert sw.height == 1 and sw["code_version"][0] == "v2" and '"a": 2' in sw["spec"][0]
    tid = store.ensure_trial(sid, "k", {"x": 1}, depth=2, init="tied", arm="none", seed=1)
    store.set_trial_status(tid, "running", bump_attempts=True)
    store.write_probe(tid, make_record(0, n_layer=2))
    # a resumed driver calls ensure_trial again: same id, status and results kept
    assert store.ensure_trial(sid, "k", {"x": 2}, depth=2, init="tied", arm="none",
                              seed=1) == tid
    t = store.get_trial(tid)
    assert t.status == "running" and t.attempts == 1 and t.config == {"x": 2}
    assert _count(store, "SELECT COUNT(*) FROM probe_metrics") > 0
    # unless asked to reset
    store.ensure_trial(sid, "k", {"x": 3}, depth=2, init="tied", arm="none", seed=1,
                       reset=True)
    t = store.get_trial(tid)
    assert t.status == "pending" and t.attempts == 0 and t.started_at is None
    assert _count(store, "SELECT COUNT(*) FROM probe_metrics") == 0
    assert _count(store, "SELECT COUNT(*) FROM trials") == 1
    assert store.trials("grid").height == 1 and store.trial_id(sid, "k") == tid


def test_rewriting_a_probe_leaves_one_row_with_latest_values(store):
    _, tid = _trial(store)
    first = make_record(100, n_layer=2, value=1.0, history=3)
    store.write_probe(tid, first)
    n_rows = _count(store, "SELECT COUNT(*) FROM probe_metrics")
    assert n_rows == len(first.metrics)
    second = make_record(100, n_layer=2, value=2.0, history=3)
    second.val_loss = 9.0
    store.write_probe(tid, second)  # a retry of the same probe with new values
    assert _count(store, "SELECT COUNT(*) FROM probe_metrics") == n_rows
    assert _count(store, "SELECT COUNT(*) FROM probes") == 1
    assert _count(store, "SELECT COUNT(*) FROM train_steps") == 3
    vals = store.sql("SELECT DISTINCT value FROM probe_metrics")["value"].to_list()
    assert vals == [2.0]
    assert store.sql("SELECT val_loss FROM probes").item() == 9.0
    # layer-level rows (head NULL) in particular: one per (layer, metric)
    n_layer_rows = _count(
        store, "SELECT COUNT(*) FROM probe_metrics WHERE head IS NULL AND layer = 0 "
        "AND metric = 'pr_q'")
    assert n_layer_rows == 1
    dup = _count(store, "SELECT COUNT(*) FROM (SELECT trial_id, step, layer, head, metric "
                 "FROM probe_metrics GROUP BY trial_id, step, layer, head, metric "
                 "HAVING COUNT(*) > 1) d")
    assert dup == 0


def test_duplicate_rows_in_one_record_keep_the_last(store):
    _, tid = _trial(store)
    rec = ProbeRecord(step=5, progress=0.5, tokens=10, train_loss=1, val_loss=1, lr=1,
                      tokens_per_s=1,
                      metrics=[(0, None, "pr_q", 1.0), (0, None, "pr_q", 3.0),
                               (0, 1, "pr_q", 5.0), (0, 1, "pr_q", 7.0)])
    store.write_probe(tid, rec)
    df = store.sql("SELECT head, value FROM probe_metrics ORDER BY head_key")
    assert df.rows() == [(None, 3.0), (1, 7.0)]


def test_non_finite_values_round_trip(store):
    _, tid = _trial(store)
    specials = [math.nan, math.inf, -math.inf, 0.0, 1e-300, 1.5e308, -2.5]  # (SQLite drops -0.0's sign)
    rec = ProbeRecord(
        step=0, progress=0.0, tokens=0, train_loss=math.nan, val_loss=math.inf,
        lr=-math.inf, tokens_per_s=math.nan,
        metrics=[(i, None if i % 2 else 0, "pr_q", v) for i, v in enumerate(specials)],
        history=[StepRecord(step=0, train_loss=math.inf, val_loss=math.nan, lr=-math.inf,
                            tokens_per_s=math.nan)],
    )
    store.write_probe(tid, rec)
    [back] = store.read_probes(tid)

    def same(a, b):
        return (math.isnan(a) and math.isnan(b)) or a == b

    for (l1, h1, n1, v1), (l2, h2, n2, v2) in zip(sorted(rec.metrics, key=lambda r: r[0]),
                                                  back.metrics):
        assert (l1, h1, n1) == (l2, h2, n2) and same(v1, v2), (v1, v2)
    for f in ("train_loss", "val_loss", "lr", "tokens_per_s"):
        assert same(getattr(rec, f), getattr(back, f)), f
        assert same(getattr(rec.history[0], f), getattr(back.history[0], f)), f
    # in SQL: NaN is NULL (both backends alike), infinities are real infinities
    assert _count(store, "SELECT COUNT(*) FROM probe_metrics WHERE value IS NULL") == 1
    assert _count(store, "SELECT COUNT(*) FROM probe_metrics WHERE value > 1.6e308") == 1
    assert _count(store, "SELECT COUNT(*) FROM probe_metrics WHERE value < -1.6e308") == 1


def test_read_probes_returns_what_was_written(store):
    _, tid = _trial(store)
    recs = [make_record(s, n_layer=2, n_head=2, history=2) for s in (0, 10, 20)]
    store.write_probes(tid, recs)
    back = store.read_probes(tid)
    assert [r.step for r in back] == [0, 10, 20]
    for a, b in zip(recs, back):
        assert sorted(a.metrics, key=lambda r: (r[0], -1 if r[1] is None else r[1], r[2])) \
            == b.metrics
        assert [h.step for h in a.history] == [h.step for h in b.history]
        assert (a.tokens, a.progress, a.val_loss) == (b.tokens, b.progress, b.val_loss)


def test_trial_info_has_every_trials_column(store):
    # get_trial builds TrialInfo from the whole row: a migration that adds a column to
    # trials without a field here breaks every read (0008's trials.cell did)
    from dataclasses import fields

    from qkgeom.store.models import Trial
    from qkgeom.store.reads import TrialInfo

    assert {f.name for f in fields(TrialInfo)} == set(Trial.__table__.columns.keys())
    sid = store.ensure_sweep("cells", {"a": 1}, "v1")
    tid = store.ensure_trial(sid, "lr0.001.d2-tied-none-s1", {"lr": 1e-3}, depth=2,
                             init="tied", arm="none", seed=1, cell="lr0.001")
    info = store.get_trial(tid)
    assert (info.cell, info.trial_key, info.seed) == ("lr0.001", "lr0.001.d2-tied-none-s1", 1)


def test_trial_status_lifecycle(store):
    sid, tid = _trial(store)
    assert store.get_trial(tid).status == "pending"
    store.set_trial_status(tid, "running", bump_attempts=True, host="node1", device="cpu")
    t1 = store.get_trial(tid)
    assert t1.started_at is not None and t1.ended_at is None and t1.attempts == 1
    assert (t1.host, t1.device) == ("node1", "cpu")
    store.set_trial_status(tid, "error", error="RuntimeError: boom")
    t2 = store.get_trial(tid)
    assert t2.ended_at is not None and t2.error == "RuntimeError: boom"
    store.set_trial_status(tid, "running", bump_attempts=True)  # a retry
    t3 = store.get_trial(tid)
    assert t3.started_at == t1.started_at and t3.ended_at is None and t3.attempts == 2
    store.set_trial_status(tid, "terminated")
    assert store.get_trial(tid).status == "terminated"
    with pytest.raises(QkgeomError, match="unknown trial status"):
        store.set_trial_status(tid, "finished")
    with pytest.raises(QkgeomError, match="no trial with id"):
        store.set_trial_status(tid + 1000, "running")


def test_test_loss_is_stored_shown_in_v_final_and_nan_is_null(store):
    sid, tid = _trial(store)
    _, t2 = _trial(store, key="d2-gaussian-none-s1", seed=1)
    store.write_probe(tid, make_record(10, n_layer=2, n_head=2, max_steps=10))
    assert store.get_trial(tid).test_loss is None  # not finished yet
    store.set_trial_result(tid, test_loss=1.875)
    store.set_trial_result(t2, test_loss=math.nan)
    assert store.get_trial(tid).test_loss == 1.875
    assert store.get_trial(t2).test_loss is None
    df = store.trials("s")
    assert dict(zip(df["trial_key"], df["test_loss"])) == {"d2-gaussian-none-s0": 1.875,
                                                          "d2-gaussian-none-s1": None}
    fin = store.sql("SELECT DISTINCT trial_id, test_loss FROM v_final")
    assert fin.rows() == [(tid, 1.875)]
    with pytest.raises(QkgeomError, match="no trial with id"):
        store.set_trial_result(tid + 1000, test_loss=1.0)


def test_mark_running_interrupted(store):
    sid, a = _trial(store, "a")
    _, b = _trial(store, "b")
    _, c = _trial(store, "c")
    store.set_trial_status(a, "running")
    store.set_trial_status(b, "running")
    store.set_trial_status(c, "terminated")
    assert store.mark_running_interrupted(sid) == 2
    assert [store.get_trial(t).status for t in (a, b, c)] == [
        "interrupted", "interrupted", "terminated"]
    assert store.get_trial(a).ended_at is not None
    assert store.mark_running_interrupted(sid) == 0


def test_checkpoints_are_idempotent(store):
    _, tid = _trial(store)
    store.add_checkpoint(tid, 100, "/runs/a/ckpt-100.pt")
    store.add_checkpoint(tid, 100, "/runs/b/ckpt-100.pt")
    store.add_checkpoint(tid, 200, "/runs/b/ckpt-200.pt")
    df = store.sql("SELECT step, location FROM checkpoints ORDER BY step")
    assert df.rows() == [(100, "/runs/b/ckpt-100.pt"), (200, "/runs/b/ckpt-200.pt")]


def test_write_to_a_missing_trial_is_an_error_and_writes_nothing(store):
    with pytest.raises(QkgeomError):
        store.write_probe(12345, make_record(0, n_layer=1))
    assert _count(store, "SELECT COUNT(*) FROM probes") == 0
    assert _count(store, "SELECT COUNT(*) FROM probe_metrics") == 0


def test_pretrained_is_idempotent(store):
    rows = [(0, None, "pr_q", 10.0), (0, 0, "pr_q", 3.0), (1, None, "entropy", math.nan)]
    rid = store.write_pretrained("gpt2", "main", None, {"d_model": 768}, rows)
    rows2 = [(0, None, "pr_q", 11.0), (0, 0, "pr_q", 4.0)]
    assert store.write_pretrained("gpt2", "main", 5, {"d_model": 768}, rows2) == rid
    other = store.write_pretrained("pythia-70m", "step1000", 1000, {}, rows)
    assert other != rid
    df = store.sql("SELECT model, revision, step, layer, head, metric, value FROM "
                   "v_pretrained WHERE model = 'gpt2' ORDER BY layer, head NULLS FIRST"
                   if store.dialect == "postgresql" else
                   "SELECT model, revision, step, layer, head, metric, value FROM "
                   "v_pretrained WHERE model = 'gpt2' ORDER BY layer, head")
    assert df.rows() == [("gpt2", "main", 5, 0, None, "pr_q", 11.0),
                         ("gpt2", "main", 5, 0, 0, "pr_q", 4.0)]
    assert _count(store, "SELECT COUNT(*) FROM pretrained_metrics") == 5


def test_a_pretrained_only_database_declares_its_metric_names(store):
    """No sweep was ever written: the names a pretrained run stores, --prerot's included,
    are still declared with their unit in metric_definitions."""
    rows = [(0, None, "pr_q", 10.0), (0, None, "pr_k_prerot", 7.0), (0, 1, "pr_q_prerot", 2.0)]
    store.write_pretrained("smollm2", "main", None, {}, rows)
    df = store.sql("SELECT name, unit, per_head FROM metric_definitions ORDER BY name")
    got = {n: (u, bool(h)) for n, u, h in df.rows()}
    for name in ("pr_q", "pr_k", "entropy", "token_erank", "pr_q_prerot", "pr_k_prerot"):
        assert name in got, name
    assert got["pr_q_prerot"] == ("dims", True) and got["entropy"] == ("nats", True)
    stored = store.sql("SELECT DISTINCT metric FROM pretrained_metrics")["metric"].to_list()
    assert set(stored) <= set(got)


def test_an_older_database_with_retired_logit_erank_rows_still_reads(store):
    """qkgeom before token_erank stored ``logit_erank`` and declared it: a newer qkgeom
    keeps both (its sync upserts the current names and deletes none), and the readers
    accept the name because the database declares it."""
    from qkgeom.analysis.correlation import metric_points
    from qkgeom.analysis.trials import check_metric, known_metrics
    from qkgeom.report.plots import METRIC_TITLES
    from qkgeom.store.models import MetricDefinition

    assert "logit_erank" not in METRICS
    sid, tid = _trial(store)
    rec = make_record(10, n_layer=2, n_head=2)
    rec.metrics += [(la, None, "logit_erank", 20.0 + la) for la in range(2)]
    store.write_probe(tid, rec)
    with store.engine.begin() as conn:  # the definition row an older qkgeom wrote
        conn.execute(MetricDefinition.__table__.insert().values(
            name="logit_erank", unit="dims", per_head=True, doc="old masked logit rank"))
    store.write_pretrained("gpt2", "main", None, {}, [(0, None, "logit_erank", 99.0)])
    store.ensure_sweep("s", {"grid": [1, 2]}, "v2")  # syncs the definitions again
    doc = store.sql("SELECT doc FROM metric_definitions WHERE name = 'logit_erank'")
    assert doc["doc"].to_list() == ["old masked logit rank"]
    assert "logit_erank" in known_metrics(store) and "token_erank" in known_metrics(store)
    assert check_metric(store, "logit_erank") == "logit_erank"
    pts = metric_points(store, "s", ["logit_erank", "token_erank"], finished_only=False)
    assert sorted(pts["logit_erank"].to_list()) == [20.0, 21.0]
    assert pts["token_erank"].null_count() == 0
    assert store.sql("SELECT value FROM pretrained_metrics WHERE metric = 'logit_erank'"
                     ).item() == 99.0
    assert "retired" in METRIC_TITLES["logit_erank"]


def test_views(store):
    sid = store.ensure_sweep("grid", {}, "v1")
    other = store.ensure_sweep("other", {}, "v1")
    tids = []
    for seed in (0, 1, 2):
        tid = store.ensure_trial(sid, f"s{seed}", {}, depth=2, init="gaussian", arm="none",
                                 seed=seed, status="terminated")
        tids.append(tid)
        for step in (0, 50, 100):
            rec = make_record(step, n_layer=2, n_head=2, max_steps=100,
                              value=float(seed + step))
            if seed == 2 and step == 100:  # one NaN: skipped by AVG, not counted
                rec.metrics = [(la, h, n, math.nan if (la, h, n) == (0, None, "pr_q") else v)
                               for la, h, n, v in rec.metrics]
            store.write_probe(tid, rec)
    t_other = store.ensure_trial(other, "x", {}, depth=3, init="tied", arm="hold", seed=0)
    store.write_probe(t_other, make_record(7, n_layer=3, n_head=2, value=-1.0))

    cols = store.sql("SELECT * FROM v_metrics WHERE 1 = 0").columns
    assert cols == ["sweep", "sweep_id", "trial_id", "trial_key", "depth", "init", "arm",
                    "seed", "status", "step", "progress", "layer", "head", "metric", "value"]
    assert store.sql("SELECT * FROM v_layer_metrics WHERE 1 = 0").columns == [
        c for c in cols if c != "head"]
    assert store.sql("SELECT * FROM v_trajectories WHERE 1 = 0").columns == [
        "sweep", "depth", "init", "arm", "layer", "metric", "step", "progress", "value",
        "n_seeds"]
    assert store.sql("SELECT * FROM v_final WHERE 1 = 0").columns == [
        "sweep", "trial_id", "depth", "init", "arm", "seed", "layer", "metric", "step",
        "value", "test_loss"]
    assert store.sql("SELECT * FROM v_pretrained WHERE 1 = 0").columns == [
        "model", "revision", "step", "layer", "head", "metric", "value"]

    n_all = _count(store, "SELECT COUNT(*) FROM probe_metrics")
    assert _count(store, "SELECT COUNT(*) FROM v_metrics") == n_all
    n_layer = len(METRICS) * 2 * 3 * 3 + len(METRICS) * 3
    assert _count(store, "SELECT COUNT(*) FROM v_layer_metrics") == n_layer

    traj = store.sql("SELECT step, progress, value, n_seeds FROM v_trajectories WHERE "
                     "sweep = 'grid' AND layer = 1 AND metric = 'entropy' ORDER BY step")
    assert traj.rows() == [(0, 0.0, 1.0, 3), (50, 0.5, 51.0, 3), (100, 1.0, 101.0, 3)]
    nan_pt = store.sql("SELECT value, n_seeds FROM v_trajectories WHERE sweep = 'grid' "
                       "AND layer = 0 AND metric = 'pr_q' AND step = 100")
    assert nan_pt.rows() == [(100.5, 2)]

    final = store.sql("SELECT trial_id, step, value FROM v_final WHERE sweep = 'grid' AND "
                      "layer = 1 AND metric = 'pr_k' ORDER BY trial_id")
    assert final.rows() == [(tids[0], 100, 100.0), (tids[1], 100, 101.0),
                            (tids[2], 100, 102.0)]
    assert _count(store, "SELECT COUNT(*) FROM v_final WHERE sweep = 'other'") == \
        len(METRICS) * 3

    heads = store.sql("SELECT value, n_heads FROM v_head_means WHERE trial_id = :t AND "
                      "step = 7 AND layer = 2 AND metric = 'qk_pr'", {"t": t_other})
    assert heads.rows() == [(-1.0, 2)]


def test_require_sweep_lists_existing_names(store):
    store.ensure_sweep("alpha", {}, "v")
    store.ensure_sweep("beta", {}, "v")
    assert store.require_sweep("beta") == store.sweep_id("beta")
    assert store.sweep_id("gamma") is None
    with pytest.raises(QkgeomError, match="no sweep named 'gamma'.*alpha, beta"):
        store.require_sweep("gamma")
    with pytest.raises(QkgeomError, match="alpha, beta"):
        store.trials("gamma")


def test_store_is_not_picklable_with_a_clear_message(store):
    with pytest.raises(TypeError, match="open_store"):
        pickle.dumps(store)
    assert "***" in repr(store) or "sqlite" in repr(store)


def test_sql_with_and_without_params(store):
    sid = store.ensure_sweep("p%q:x", {}, "v")
    # verbatim SQL: '%' and ':x' are not placeholders
    assert store.sql("SELECT name FROM sweeps WHERE name LIKE 'p%q:x'").item() == "p%q:x"
    assert store.sql("SELECT id FROM sweeps WHERE name = :n", {"n": "p%q:x"}).item() == sid


def test_in_memory_sqlite_is_created_at_head():
    from qkgeom.store import head_revision, open_store

    with open_store("sqlite://") as mem:
        assert mem.revision == head_revision()
        _, tid = _trial(mem)
        mem.write_probe(tid, make_record(0, n_layer=1))
        assert len(mem.read_probes(tid)) == 1
