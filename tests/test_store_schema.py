"""Schema revisions: create at head, upgrade/downgrade round trip, model/migration diff,
refusal of out-of-date and newer databases (SQLite and PostgreSQL)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import invoke
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.engine import make_url

from qkgeom.store import VIEWS, SchemaError, head_revision, open_store
from qkgeom.store.models import TABLES, Base
from qkgeom.store.schema import current, downgrade, known_revisions, upgrade


def _tables_and_views(url: str) -> tuple[set[str], set[str]]:
    eng = create_engine(url)
    try:
        insp = inspect(eng)
        return set(insp.get_table_names()), set(insp.get_view_names())
    finally:
        eng.dispose()


def _diff(url: str) -> list:
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    eng = create_engine(url)
    try:
        with eng.connect() as conn:
            mc = MigrationContext.configure(conn, opts={"compare_type": True})
            return compare_metadata(mc, Base.metadata)
    finally:
        eng.dispose()


def _set_version(url: str, rev: str) -> None:
    eng = create_engine(url)
    with eng.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = :r"), {"r": rev})
    eng.dispose()


def _version(url: str) -> str:
    eng = create_engine(url)
    with eng.connect() as conn:
        v = conn.execute(text("SELECT version_num FROM alembic_version")).scalar_one()
    eng.dispose()
    return v


def test_revisions_are_readable_and_linear():
    from alembic.script import ScriptDirectory

    from qkgeom.store.schema import alembic_config

    revs = known_revisions()
    assert revs[0] == "0001_initial" and len(revs) >= 2
    assert revs[-1] == head_revision()
    # a chain: one base, one head, each revision's down_revision the one before it, and
    # every revision id starting with its position (0001_, 0002_, ...)
    script = ScriptDirectory.from_config(alembic_config())
    assert script.get_bases() == ["0001_initial"]
    assert script.get_heads() == [revs[-1]]
    assert len(set(revs)) == len(revs)
    for i, rev in enumerate(revs):
        r = script.get_revision(rev)
        assert r.down_revision == (revs[i - 1] if i else None), rev
        assert rev.startswith(f"{i + 1:04d}_"), rev
        assert not r.branch_labels and not r.dependencies, rev
        assert list(r.nextrev) == ([revs[i + 1]] if i + 1 < len(revs) else []), rev


def test_populated_database_upgrades_from_the_first_revision(db_url):
    """A database written at 0001_initial (by plain SQL, as that qkgeom wrote it) keeps
    every value through ``qkgeom db upgrade`` to head, and reads back through the views."""
    import datetime as dt
    import math

    from sqlalchemy import MetaData

    upgrade(db_url, "0001_initial")
    assert _version(db_url) == "0001_initial"
    now = dt.datetime(2025, 12, 1, 12, 0, tzinfo=dt.timezone.utc)
    metrics = [(step, layer, head, name, value)
               for step in (0, 50) for layer in (0, 1) for head in (None, 0, 1)
               for name, value in (("pr_q", 10.0 + layer + step / 100 + (head or 0) / 8),
                                   ("pr_k", None if (step, layer, head) == (50, 1, None)
                                    else 7.25 - layer + step / 200))]
    eng = create_engine(db_url)
    try:
        with eng.begin() as conn:
            md = MetaData()
            md.reflect(conn)
            t = md.tables
            conn.execute(t["sweeps"].insert(), [dict(id=1, name="old", spec={"preset": "x"},
                                                     code_version="0.0.1", created_at=now)])
            conn.execute(t["trials"].insert(), [dict(
                id=1, sweep_id=1, trial_key="d2-gaussian-none-s3", config={"max_steps": 50},
                depth=2, init="gaussian", arm="none", seed=3, status="terminated", attempts=2,
                error="RuntimeError: once", created_at=now, started_at=now, ended_at=now,
                host="h", device="cpu")])
            conn.execute(t["probes"].insert(), [
                dict(trial_id=1, step=s, progress=s / 50, tokens=s * 64, train_loss=3.0 - s / 50,
                     val_loss=3.1 - s / 50, lr=1e-3, tokens_per_s=100.0) for s in (0, 50)])
            conn.execute(t["probe_metrics"].insert(), [
                dict(trial_id=1, step=s, layer=la, head_key=-1 if h is None else h, head=h,
                     metric=n, progress=s / 50, value=v) for s, la, h, n, v in metrics])
            conn.execute(t["pretrained_runs"].insert(), [dict(
                id=1, model="gpt2", revision="main", step=None, meta={"tokens": 9},
                created_at=now)])
            conn.execute(t["pretrained_metrics"].insert(), [
                dict(run_id=1, layer=0, head_key=-1, head=None, metric="pr_q", value=4.5)])
    finally:
        eng.dispose()

    r = invoke("db", "upgrade", "--db", db_url)
    assert r.exit_code == 0, r.output
    assert "0001_initial -> " + head_revision() in r.output
    assert _version(db_url) == head_revision()
    assert _diff(db_url) == []
    with open_store(db_url, create=False, readonly=True) as store:
        tr = store.trials("old").to_dicts()
        assert len(tr) == 1
        assert {k: tr[0][k] for k in ("trial_key", "depth", "init", "arm", "seed", "status",
                                        "attempts", "error", "host", "device")} == dict(
            trial_key="d2-gaussian-none-s3", depth=2, init="gaussian", arm="none", seed=3,
            status="terminated", attempts=2, error="RuntimeError: once", host="h",
            device="cpu")
        (rec0, rec50) = store.read_probes(tr[0]["id"])
        assert (rec50.step, rec50.tokens, rec50.val_loss) == (50, 3200, pytest.approx(2.1))
        got = {(s, la, h, n): v for s, rec in ((0, rec0), (50, rec50))
               for la, h, n, v in rec.metrics}
        assert len(got) == len(metrics)
        for s, la, h, n, v in metrics:
            g = got[(s, la, h, n)]
            assert (math.isnan(g) if v is None else g == v), (s, la, h, n)
        lay = store.sql("SELECT step, layer, metric, value FROM v_layer_metrics "
                        "WHERE sweep = 'old' ORDER BY step, layer, metric").rows()
        want = sorted((s, la, n, v) for s, la, h, n, v in metrics if h is None)
        assert [r[:3] for r in lay] == [w[:3] for w in want]
        for g, w in zip(lay, want):
            assert (g[3] is None or math.isnan(g[3])) if w[3] is None else g[3] == w[3]
        pre = store.sql("SELECT model, revision, layer, metric, value FROM v_pretrained").rows()
        assert pre == [("gpt2", "main", 0, "pr_q", 4.5)]


def test_new_database_is_created_at_head(db_url):
    store = open_store(db_url)
    store.close()
    assert current(db_url).verdict == "head"
    assert _version(db_url) == head_revision()
    tables, views = _tables_and_views(db_url)
    assert set(TABLES) <= tables
    assert set(VIEWS) <= views


def test_upgrade_downgrade_upgrade_and_empty_diff(db_url):
    before, after = upgrade(db_url)
    assert before.verdict == "empty" and after.verdict == "head"
    assert _diff(db_url) == []
    downgrade(db_url, "base")
    tables, views = _tables_and_views(db_url)
    assert not (tables & set(TABLES)) and not (views & set(VIEWS))
    upgrade(db_url)
    assert current(db_url).verdict == "head"
    assert _diff(db_url) == []
    # one step at a time too
    downgrade(db_url, "-1")
    assert current(db_url).verdict == "outdated"
    upgrade(db_url)
    assert _diff(db_url) == []


def test_out_of_date_database_is_refused(db_url):
    upgrade(db_url)
    downgrade(db_url, "0001_initial")
    with pytest.raises(SchemaError) as e:
        open_store(db_url)
    msg = str(e.value)
    assert "run: qkgeom db upgrade --db" in msg and "0001_initial" in msg
    r = invoke("query", "--db", db_url, "SELECT 1 AS one")
    assert r.exit_code != 0 and "qkgeom db upgrade --db" in r.output
    assert _version(db_url) == "0001_initial"  # nothing touched
    r = invoke("db", "upgrade", "--db", db_url)
    assert r.exit_code == 0, r.output
    assert "0001_initial -> " + head_revision() in r.output
    open_store(db_url).close()


def test_newer_database_is_refused_never_downgraded(db_url):
    upgrade(db_url)
    _set_version(db_url, "9999_from_the_future")
    with pytest.raises(SchemaError) as e:
        open_store(db_url)
    assert "newer qkgeom" in str(e.value) and "9999_from_the_future" in str(e.value)
    for args in (["db", "upgrade"], ["query"], ["export", "--out", "unused"]):
        extra = ["SELECT 1"] if args == ["query"] else []
        r = invoke(*args, "--db", db_url, *extra)
        assert r.exit_code != 0, (args, r.output)
        assert "newer qkgeom" in r.output
    assert _version(db_url) == "9999_from_the_future"
    r = invoke("db", "current", "--db", db_url)
    assert r.exit_code == 0 and "9999_from_the_future" in r.output and "newer" in r.output


def test_db_current_and_upgrade_cli(db_url):
    if db_url.startswith("sqlite"):
        Path(make_url(db_url).database).touch()  # an empty file is an empty database
    r = invoke("db", "current", "--db", db_url)
    assert r.exit_code == 0 and "empty database" in r.output
    r = invoke("db", "upgrade", "--db", db_url)
    assert r.exit_code == 0 and f"empty -> {head_revision()}" in r.output
    r = invoke("db", "upgrade", "--db", db_url)
    assert r.exit_code == 0 and "already at" in r.output
    r = invoke("db", "current", "--db", db_url)
    assert r.exit_code == 0 and f"{head_revision()} (head)" in r.output


def test_tables_without_version_are_refused(sqlite_url):
    eng = create_engine(sqlite_url)
    with eng.begin() as conn:
        conn.execute(text("CREATE TABLE sweeps (id INTEGER PRIMARY KEY)"))
    eng.dispose()
    with pytest.raises(SchemaError, match="no alembic_version"):
        open_store(sqlite_url)


def test_db_current_does_not_create_a_file(tmp_path):
    path = tmp_path / "missing.db"
    r = invoke("db", "current", "--db", str(path))
    assert r.exit_code != 0 and "no database at" in r.output
    assert not path.exists()


def test_0004_adds_test_loss_and_keeps_rows_both_ways(db_url):
    from helpers import make_record

    upgrade(db_url, "0002_views")
    eng = create_engine(db_url)
    with eng.begin() as conn:
        conn.execute(text("INSERT INTO sweeps (id, name, spec, code_version, created_at) "
                          "VALUES (1, 'old', '{}', 'v', CURRENT_TIMESTAMP)"))
        conn.execute(text("INSERT INTO trials (id, sweep_id, trial_key, config, depth, init, "
                          "arm, seed, status, attempts, created_at) VALUES (1, 1, 'k', '{}', "
                          "2, 'gaussian', 'none', 0, 'terminated', 1, CURRENT_TIMESTAMP)"))
    eng.dispose()
    upgrade(db_url)
    assert _version(db_url) == head_revision()
    with open_store(db_url) as store:
        store.write_probe(1, make_record(5, n_layer=1, n_head=1, max_steps=5))
        store.set_trial_result(1, test_loss=2.5)
        assert store.sql("SELECT DISTINCT trial_key FROM v_metrics").item() == "k"
        assert store.sql("SELECT DISTINCT test_loss FROM v_final").item() == 2.5
    downgrade(db_url, "0002_views")
    eng = create_engine(db_url)
    with eng.connect() as conn:
        assert conn.execute(text("SELECT trial_key FROM trials")).scalar_one() == "k"
        cols = conn.execute(text("SELECT * FROM v_final WHERE 1 = 0")).keys()
        assert "test_loss" not in list(cols) and conn.execute(
            text("SELECT COUNT(*) FROM v_final")).scalar_one() > 0
    eng.dispose()


def test_0005_adds_baseline_ref_and_keeps_rows_both_ways(db_url):
    upgrade(db_url, "0004_test_loss")
    eng = create_engine(db_url)
    with eng.begin() as conn:
        conn.execute(text("INSERT INTO sweeps (id, name, spec, code_version, created_at) "
                          "VALUES (1, 'old', '{}', 'v', CURRENT_TIMESTAMP)"))
        conn.execute(text("INSERT INTO trials (id, sweep_id, trial_key, config, depth, init, "
                          "arm, seed, status, attempts, created_at) VALUES (1, 1, 'k', '{}', "
                          "2, 'gaussian', 'shrink', 0, 'terminated', 1, CURRENT_TIMESTAMP)"))
    eng.dispose()
    upgrade(db_url)
    assert _version(db_url) == head_revision()
    ref = {"trial": "d2-gaussian-none-s0", "attempt": 1, "metric": "pr_wk", "digest": "ab"}
    with open_store(db_url) as store:
        assert store.trials("old")["baseline_ref"].to_list() == [None]
        store.set_baseline_ref(1, ref)
        import json

        assert json.loads(store.trials("old")["baseline_ref"][0]) == ref
    downgrade(db_url, "0004_test_loss")
    eng = create_engine(db_url)
    with eng.connect() as conn:
        assert conn.execute(text("SELECT trial_key FROM trials")).scalar_one() == "k"
        cols = conn.execute(text("SELECT * FROM trials WHERE 1 = 0")).keys()
        assert "baseline_ref" not in list(cols)
    eng.dispose()


def test_0006_adds_heartbeats_and_keeps_rows_both_ways(db_url):
    upgrade(db_url, "0005_baseline_ref")
    eng = create_engine(db_url)
    with eng.begin() as conn:
        conn.execute(text("INSERT INTO sweeps (id, name, spec, code_version, created_at) "
                          "VALUES (1, 'old', '{}', 'v', CURRENT_TIMESTAMP)"))
        conn.execute(text("INSERT INTO trials (id, sweep_id, trial_key, config, depth, init, "
                          "arm, seed, status, attempts, created_at) VALUES (1, 1, 'k', '{}', "
                          "2, 'gaussian', 'none', 0, 'running', 1, CURRENT_TIMESTAMP)"))
    eng.dispose()
    upgrade(db_url)
    assert _version(db_url) == head_revision()
    with open_store(db_url, create=False) as store:
        # rows of older revisions promise no heartbeat: nothing is judged stale
        assert store.sweeps()["heartbeat_s"].to_list() == [None]
        assert store.trials("old")["heartbeat_at"].to_list() == [None]
        assert store.heartbeat(1) == 1
        assert store.trials("old")["heartbeat_at"][0] is not None
    downgrade(db_url, "0005_baseline_ref")
    eng = create_engine(db_url)
    with eng.connect() as conn:
        assert conn.execute(text("SELECT trial_key FROM trials")).scalar_one() == "k"
        assert "heartbeat_at" not in list(conn.execute(text("SELECT * FROM trials WHERE 1 = 0"))
                                          .keys())
        assert "heartbeat_s" not in list(conn.execute(text("SELECT * FROM sweeps WHERE 1 = 0"))
                                         .keys())
    eng.dispose()


def test_0007_adds_trial_attempts_and_keeps_rows_both_ways(db_url):
    upgrade(db_url, "0006_heartbeat")
    eng = create_engine(db_url)
    with eng.begin() as conn:
        conn.execute(text("INSERT INTO sweeps (id, name, spec, code_version, created_at) "
                          "VALUES (1, 'old', '{}', 'v', CURRENT_TIMESTAMP)"))
        conn.execute(text("INSERT INTO trials (id, sweep_id, trial_key, config, depth, init, "
                          "arm, seed, status, attempts, created_at) VALUES (1, 1, 'k', '{}', "
                          "2, 'gaussian', 'none', 0, 'terminated', 2, CURRENT_TIMESTAMP)"))
    eng.dispose()
    upgrade(db_url)
    assert _version(db_url) == head_revision()
    with open_store(db_url, create=False) as store:
        assert store.attempts("old").height == 0  # older attempts have no row
        assert store.record_attempt(1, {"git_commit": "abc", "git_dirty": True}) == 2
        row = store.attempts("old").to_dicts()[0]
        assert (row["attempt"], row["git_commit"], row["git_dirty"]) == (2, "abc", True)
    downgrade(db_url, "0006_heartbeat")
    tables, _ = _tables_and_views(db_url)
    assert "trial_attempts" not in tables and "trials" in tables
    eng = create_engine(db_url)
    with eng.connect() as conn:
        assert conn.execute(text("SELECT attempts FROM trials")).scalar_one() == 2
    eng.dispose()
