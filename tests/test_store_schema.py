"""Schema revisions: create at head, upgrade/downgrade round trip, model/migration diff,
refusal of out-of-date and newer databases (SQLite and PostgreSQL)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest_store import invoke
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.engine import make_url

from qkgeom.store import VIEWS, SchemaError, head_revision, open_store
from qkgeom.store.models import TABLES, Base
from qkgeom.store.schema import current, downgrade, known_revisions, upgrade

pytest_plugins = ["store_fixtures"]  # db_url, sqlite_url, pg_url


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
    revs = known_revisions()
    assert revs[0] == "0001_initial" and len(revs) >= 2
    assert revs[-1] == head_revision()


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
    from conftest_store import make_record

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
