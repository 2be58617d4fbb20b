"""The ``checkpoints`` table's kinds (resume | snapshot): migration 0003 on existing rows,
the downgrade, and the guarded delete the sweep's pruning uses. SQLite and PostgreSQL."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import IntegrityError

from qkgeom.errors import QkgeomError
from qkgeom.store import open_store
from qkgeom.store.schema import downgrade, upgrade


def _rows(url: str) -> list[tuple]:
    eng = create_engine(url)
    try:
        with eng.connect() as c:
            cols = [r[0] for r in c.execute(text(
                "SELECT column_name FROM information_schema.columns WHERE table_name = "
                "'checkpoints' AND table_schema = current_schema()")).fetchall()] if eng.dialect.name == "postgresql" else [
                r[1] for r in c.execute(text("PRAGMA table_info(checkpoints)")).fetchall()]
            sel = "kind, step, location" if "kind" in cols else "'-', step, location"
            return [tuple(r) for r in c.execute(text(
                f"SELECT {sel} FROM checkpoints ORDER BY step, location")).fetchall()]
    finally:
        eng.dispose()


def _exec(url: str, sql: str, **params) -> None:
    eng = create_engine(url)
    try:
        with eng.begin() as c:
            c.execute(text(sql), params)
    finally:
        eng.dispose()


def test_existing_rows_become_resume_and_downgrade_keeps_the_snapshot(db_url):
    upgrade(db_url, "0002_views")
    _exec(db_url, "INSERT INTO sweeps (id, name, spec, code_version, created_at) VALUES "
          "(1, 's', '{}', 'v', CURRENT_TIMESTAMP)")
    _exec(db_url, "INSERT INTO trials (id, sweep_id, trial_key, config, depth, init, arm, seed, "
          "status, attempts, created_at) VALUES (1, 1, 'k', '{}', 1, 'gaussian', 'none', 0, "
          "'terminated', 1, CURRENT_TIMESTAMP)")
    for step in (0, 20):
        _exec(db_url, "INSERT INTO checkpoints (trial_id, step, location, created_at) VALUES "
              "(1, :s, :loc, CURRENT_TIMESTAMP)", s=step, loc=f"/ray/checkpoint_{step}")
    upgrade(db_url)
    assert _rows(db_url) == [("resume", 0, "/ray/checkpoint_0"),
                             ("resume", 20, "/ray/checkpoint_20")]
    # both kinds at one step; a bad kind is refused by the CHECK constraint and the API
    with open_store(db_url) as store:
        store.add_checkpoint(1, 20, "/ray/snapshots/step_0000020", kind="snapshot")
        store.add_checkpoint(1, 20, "/ray/snapshots/step_0000020b", kind="snapshot")  # upsert
        with pytest.raises(QkgeomError, match="unknown checkpoint kind"):
            store.add_checkpoint(1, 40, "/x", kind="weights")
    with pytest.raises(IntegrityError, match="ck_checkpoints_kind|CHECK constraint"):
        _exec(db_url, "INSERT INTO checkpoints (trial_id, kind, step, location, created_at) "
              "VALUES (1, 'weights', 40, '/x', CURRENT_TIMESTAMP)")
    assert _rows(db_url) == [("resume", 0, "/ray/checkpoint_0"),
                             ("resume", 20, "/ray/checkpoint_20"),
                             ("snapshot", 20, "/ray/snapshots/step_0000020b")]
    downgrade(db_url, "0002_views")
    # one row per (trial, step) again: the snapshot wins at step 20
    assert _rows(db_url) == [("-", 0, "/ray/checkpoint_0"),
                             ("-", 20, "/ray/snapshots/step_0000020b")]
    upgrade(db_url)


def test_delete_checkpoint_only_forgets_the_named_location(store):
    sid = store.ensure_sweep("s", {}, "v")
    tid = store.ensure_trial(sid, "k", {}, depth=1, init="gaussian", arm="none", seed=0)
    store.add_checkpoint(tid, 20, "/a/checkpoint_000001")
    store.add_checkpoint(tid, 20, "/a/snap", kind="snapshot")
    # a newer save of step 20 (after a retry) replaced the location: pruning the old one
    # must not forget the new row
    store.add_checkpoint(tid, 20, "/a/checkpoint_000004")
    assert store.delete_checkpoint(tid, 20, "resume", location="/a/checkpoint_000001") == 0
    assert store.delete_checkpoint(tid, 20, "resume", location="/a/checkpoint_000004") == 1
    df = store.sql("SELECT kind, step, location FROM checkpoints")
    assert list(df.iter_rows()) == [("snapshot", 20, "/a/snap")]
