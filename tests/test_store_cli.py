"""``qkgeom query`` / ``export`` / ``db``: formats, read-only enforcement, bad input."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import polars as pl
import pytest
from helpers import free_port, invoke, make_record

from qkgeom.store import TABLES, open_store


@pytest.fixture
def filled(db_url):
    """A database with one sweep, two trials and three probes each."""
    with open_store(db_url) as store:
        sid = store.ensure_sweep("grid", {"seeds": [0, 1]}, "v1")
        for seed in (0, 1):
            tid = store.ensure_trial(sid, f"s{seed}", {"seed": seed}, depth=2,
                                     init="gaussian", arm="none", seed=seed)
            store.write_probes(tid, [make_record(s, n_layer=2, n_head=2, history=2)
                                     for s in (0, 10, 20)])
        n = int(store.sql("SELECT COUNT(*) FROM probe_metrics").item())
    return db_url, n


def _one_line_error(r) -> str:
    assert r.exit_code != 0, r.output
    out = r.output.strip()
    assert out.startswith("Error: ") and "\n" not in out, out
    assert "Traceback" not in out
    return out


def test_query_formats(filled, tmp_path):
    url, n = filled
    sql = "SELECT trial_id, step, layer, metric, value FROM v_final ORDER BY 1, 3, 4"
    r = invoke("query", "--db", url, sql)
    assert r.exit_code == 0, r.output
    assert "metric" in r.output and "entropy" in r.output and "│" in r.output
    r = invoke("query", "--db", url, "--format", "csv", sql)
    assert r.exit_code == 0
    assert r.output.splitlines()[0] == "trial_id,step,layer,metric,value"
    assert len(r.output.splitlines()) == 1 + 2 * 2 * 10
    r = invoke("query", "--db", url, "--format", "json", "SELECT name, spec FROM sweeps")
    assert json.loads(r.output) == [{"name": "grid", "spec": '{"seeds": [0, 1]}'}]
    out = tmp_path / "final.parquet"
    r = invoke("query", "--db", url, "--format", "parquet", "--out", str(out), sql)
    assert r.exit_code == 0, r.output
    df = pl.read_parquet(out)
    assert df.height == 40 and df.columns == ["trial_id", "step", "layer", "metric", "value"]
    csv = tmp_path / "all.csv"
    r = invoke("query", "--db", url, "--format", "csv", "--out", str(csv),
               "SELECT COUNT(*) AS n FROM probe_metrics")
    assert csv.read_text().split() == ["n", str(n)]


def test_delete_is_refused_without_write_and_changes_nothing(filled):
    url, n = filled
    for sql in ("DELETE FROM probe_metrics",
                "UPDATE probe_metrics SET value = -12345",
                "DROP TABLE checkpoints"):
        out = _one_line_error(invoke("query", "--db", url, sql))
        assert "--write" in out and "read-only" in out
    with open_store(url) as store:
        assert int(store.sql("SELECT COUNT(*) FROM probe_metrics").item()) == n
        assert int(store.sql("SELECT COUNT(*) FROM probe_metrics WHERE value = -12345")
                   .item()) == 0
        assert int(store.sql("SELECT COUNT(*) FROM checkpoints").item()) == 0
    # with --write it runs and commits
    r = invoke("query", "--db", url, "--write", "DELETE FROM probe_metrics WHERE step = 0")
    assert r.exit_code == 0, r.output
    assert "row(s) affected" in r.output
    with open_store(url) as store:
        left = int(store.sql("SELECT COUNT(*) FROM probe_metrics").item())
    assert 0 < left < n


def test_postgres_read_only_cannot_be_switched_off(pg_url):
    with open_store(pg_url) as store:
        store.ensure_sweep("keep", {}, "v")
    out = _one_line_error(invoke("query", "--db", pg_url,
                                 "SET TRANSACTION READ WRITE; DELETE FROM sweeps"))
    assert "read" in out.lower()
    _one_line_error(invoke("query", "--db", pg_url, "COMMIT; DELETE FROM sweeps"))
    with open_store(pg_url) as store:
        assert store.sweep_id("keep") is not None


def test_sql_error_is_one_line(filled):
    url, _ = filled
    out = _one_line_error(invoke("query", "--db", url, "SELECT nope FROM nowhere"))
    assert "nowhere" in out


def test_export_writes_every_table(filled, tmp_path):
    url, n = filled
    out = tmp_path / "export"
    r = invoke("export", "--db", url, "--out", str(out), "--views")
    assert r.exit_code == 0, r.output
    for t in TABLES:
        assert (out / f"{t}.parquet").exists(), t
    pm = pl.read_parquet(out / "probe_metrics.parquet")
    assert pm.height == n and pm["value"].dtype == pl.Float64
    trials = pl.read_parquet(out / "trials.parquet")
    assert trials.height == 2 and json.loads(trials["config"][0]) == {"seed": 0}
    assert pl.read_parquet(out / "v_final.parquet").height == 2 * 2 * 10
    assert pl.read_parquet(out / "checkpoints.parquet").height == 0


# ---------------------------------------------------------------------- bad input
COMMANDS = [
    ["query", "SELECT 1"],
    ["db", "current"],
    ["db", "upgrade"],
    ["export", "--out", "EXPORT"],
]


def _cmd(cmd: list[str], db: str, tmp_path: Path) -> list[str]:
    cmd = [str(tmp_path / "exp") if c == "EXPORT" else c for c in cmd]
    # options go before the positional SQL
    return cmd[:-1] + ["--db", db, cmd[-1]] if cmd[0] == "query" else cmd + ["--db", db]


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_malformed_url(cmd, tmp_path):
    out = _one_line_error(invoke(*_cmd(cmd, "postgresql+psycopg://u:hunter2@h:port/db",
                                       tmp_path)))
    assert "malformed database URL" in out and "e.g." in out and "hunter2" not in out


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_unreachable_postgres(cmd, tmp_path):
    url = f"postgresql+psycopg://qk:hunter2@127.0.0.1:{free_port()}/qkgeom"
    t0 = time.monotonic()
    out = _one_line_error(invoke(*_cmd(cmd, url, tmp_path)))
    assert time.monotonic() - t0 < 10
    assert "cannot open database" in out and "hunter2" not in out and "qk:***@" in out


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_non_database_file_is_untouched(cmd, tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("these are my notes, not a database\n" * 50)
    before = hashlib.sha256(f.read_bytes()).hexdigest()
    out = _one_line_error(invoke(*_cmd(cmd, str(f), tmp_path)))
    assert "not a SQLite database" in out
    assert hashlib.sha256(f.read_bytes()).hexdigest() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # no -wal, no export


def test_query_on_a_missing_file_creates_nothing(tmp_path):
    out = _one_line_error(invoke("query", "--db", str(tmp_path / "nope.db"), "SELECT 1"))
    assert "no database at" in out and "qkgeom db upgrade" in out
    assert list(tmp_path.iterdir()) == []


def test_qkgeom_db_env_is_the_default(filled, monkeypatch):
    url, _ = filled
    r = invoke("query", "SELECT name FROM sweeps", env={"QKGEOM_DB": url})
    assert r.exit_code == 0 and "grid" in r.output
