"""``qkgeom db merge`` driven as a user runs it: sweeps copied between SQLite and PostgreSQL
databases with every row of their trials (compared row by row with the source, ids aside),
the source never changed, and every refusal (a name clash, a running trial, the same
database twice, a bad --rename) leaving the target as it was."""

from __future__ import annotations

import math

import pytest
from helpers import invoke, make_record

TABLES = ["trials", "trial_attempts", "probes", "probe_metrics", "train_steps", "checkpoints"]


def fill(url: str, name: str, *, n_trials: int = 2, running: bool = False) -> None:
    """A sweep of ``n_trials`` finished trials with probes, history, attempts, a checkpoint,
    a NaN, an infinity and a baseline reference: every kind of row a merge must carry."""
    from qkgeom.store import open_store

    with open_store(url) as store:
        sid = store.ensure_sweep(name, {"name": name, "grid": {"seeds": [0, 1]}}, "0.1.0+test",
                                 heartbeat_s=15.0)
        for i in range(n_trials):
            tid = store.ensure_trial(sid, f"d2-gaussian-none-s{i}", {"seed": i, "lr": 1e-3},
                                     depth=2, init="gaussian", arm="none", seed=i,
                                     cell="e48" if i % 2 == 0 else "e64")
            store.set_trial_status(tid, "running", bump_attempts=True)
            store.record_attempt(tid, {"code_version": "0.1.0+test", "host": "h",
                                       "details": {"threads": 1}})
            recs = [make_record(s, n_layer=2, n_head=2, history=2) for s in (0, 5, 10)]
            recs[1].metrics.append((0, None, "qk_erank", math.inf))
            recs[2].metrics.append((1, None, "qk_erank", math.nan))
            store.write_probes(tid, recs)
            store.add_checkpoint(tid, 10, f"/runs/{name}/t{i}/ckpt", kind="snapshot")
            store.set_baseline_ref(tid, {"trial_key": "base", "attempt": 1})
            store.set_trial_result(tid, test_loss=1.5 + i)
            if not (running and i == 0):
                store.set_trial_status(tid, "terminated")


def rows(url: str, sweep: str) -> dict[str, list[tuple]]:
    """Every row of the sweep, per table, with ids replaced by trial keys (what a merge
    must keep), in a fixed order; NaN as None (stored NULL), datetimes to the second."""
    from qkgeom.store import open_store

    out: dict[str, list[tuple]] = {}
    with open_store(url, create=False, readonly=True) as store:
        keys = {r["id"]: r["trial_key"] for r in store.trials(sweep).iter_rows(named=True)}
        from sqlalchemy import select

        from qkgeom.store.models import TRIAL_TABLES, Sweep, Trial

        def norm(v):
            if hasattr(v, "isoformat"):
                v = v.replace(tzinfo=None, microsecond=0).isoformat()
            return None if isinstance(v, float) and v != v else v

        with store.engine.connect() as conn:
            s = Sweep.__table__
            sw = conn.execute(select(s).where(s.c.name == sweep)).one()._mapping
            out["sweeps"] = [tuple(norm(v) for k, v in sw.items() if k not in ("id", "name"))]
            t = Trial.__table__
            out["trials"] = sorted(
                tuple(norm(v) for k, v in r._mapping.items() if k not in ("id", "sweep_id"))
                for r in conn.execute(select(t).where(t.c.id.in_(list(keys)))))
            for tab in TRIAL_TABLES:
                got = conn.execute(select(tab).where(tab.c.trial_id.in_(list(keys)))).all()
                out[tab.name] = sorted(
                    tuple(keys[v] if k == "trial_id" else norm(v)
                          for k, v in r._mapping.items()) for r in got)
    return out


def counts(url: str) -> dict[str, int]:
    from sqlalchemy import func, select

    from qkgeom.store import open_store
    from qkgeom.store.models import Base

    with open_store(url, create=False, readonly=True) as store, store.engine.connect() as c:
        return {n: c.execute(select(func.count()).select_from(Base.metadata.tables[n]))
                .scalar_one() for n in ["sweeps", *TABLES]}


def killed_writer_renames(path) -> None:
    """A writer renames every sweep to 'late', commits and dies (os._exit): its change
    lives in the -wal only, never checkpointed into the file."""
    import subprocess
    import sys

    code = ("import os, sqlite3, sys\n"
            "c = sqlite3.connect(sys.argv[1])\n"
            "c.execute(\"UPDATE sweeps SET name = 'late'\")\n"
            "c.commit()\n"
            "os._exit(0)\n")
    subprocess.run([sys.executable, "-c", code, str(path)], check=True)


@pytest.mark.parametrize("direction", ["sqlite->postgresql", "postgresql->sqlite",
                                       "sqlite->sqlite"])
def test_merge_copies_every_row_and_changes_no_source_row(direction, sqlite_url, tmp_path,
                                                          request):
    other = f"sqlite:///{tmp_path / 'other.db'}"
    pg = request.getfixturevalue("pg_url") if "postgresql" in direction else None
    src, dst = {"sqlite->postgresql": (sqlite_url, pg), "postgresql->sqlite": (pg, sqlite_url),
                "sqlite->sqlite": (sqlite_url, other)}[direction]
    fill(src, "e96", n_trials=3)
    fill(src, "e128", n_trials=2)
    fill(dst, "cpu", n_trials=2)  # already in the target: must stay as it is
    before_src = {n: rows(src, n) for n in ("e96", "e128")}
    before_dst = rows(dst, "cpu")
    r = invoke("db", "merge", "--from", src, "--db", dst)
    assert r.exit_code == 0, r.output
    assert "copied sweep e96: 3 trials" in r.output and "copied sweep e128: 2 trials" in r.output
    for n in ("e96", "e128"):
        assert rows(dst, n) == before_src[n]  # every row, ids aside
        assert rows(src, n) == before_src[n]  # the source is unchanged
    assert rows(dst, "cpu") == before_dst
    # the merged sweeps are read like any other
    r = invoke("query", "--db", dst, "--format", "csv",
               "select cell, count(*) as n from v_factors group by cell order by cell")
    assert r.exit_code == 0, r.output
    assert r.output.split() == ["cell,n", "e48,4", "e64,3"]  # cpu 1+1, e96 2+1, e128 1+1


def test_a_clash_a_running_trial_and_bad_arguments_are_refused_and_nothing_is_written(
        sqlite_url, tmp_path):
    src = f"sqlite:///{tmp_path / 'src.db'}"
    fill(src, "cpu")
    fill(src, "busy", running=True)
    fill(sqlite_url, "cpu")
    before = counts(sqlite_url), rows(sqlite_url, "cpu")
    cases = [
        ((), "sweep 'cpu' already exists in"),
        (("--sweep", "cpu"), "Give --rename cpu=cpu-2"),
        (("--sweep", "busy"), "sweep 'busy' has 1 trial(s) still running"),
        (("--sweep", "nope"), "no sweep named 'nope' in"),
        (("--sweep", "cpu", "--rename", "cpu"), "give OLD=NEW"),
        (("--sweep", "cpu", "--rename", "other=x"), "'other' is not among the sweeps"),
        (("--sweep", "cpu", "--sweep", "busy", "--rename", "cpu=busy", "--rename", "busy=x"),
         "has 1 trial(s) still running"),
    ]
    for extra, message in cases:
        r = invoke("db", "merge", "--from", src, "--db", sqlite_url, *extra)
        assert r.exit_code != 0 and message in r.output, (extra, r.output)
        assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1
        assert (counts(sqlite_url), rows(sqlite_url, "cpu")) == before
    r = invoke("db", "merge", "--from", src, "--db", src)
    assert r.exit_code != 0 and "the same database" in r.output
    r = invoke("db", "merge", "--from", f"sqlite:///{tmp_path / 'none.db'}", "--db", sqlite_url)
    assert r.exit_code != 0 and "Traceback" not in r.output
    assert not (tmp_path / "none.db").exists()  # a missing source is not created
    # the way out the message names works, and the copy is the source's
    r = invoke("db", "merge", "--from", src, "--db", sqlite_url, "--sweep", "cpu",
               "--rename", "cpu=cpu-2")
    assert r.exit_code == 0, r.output
    assert "copied sweep cpu -> cpu-2: 2 trials" in r.output
    assert rows(sqlite_url, "cpu-2") == rows(src, "cpu")
    assert rows(sqlite_url, "cpu") == before[1]


def test_a_merged_sweep_gives_the_statistics_of_its_source(tmp_path):
    """The statistics read the copy exactly as they read the original."""
    import json

    src, dst = (f"sqlite:///{tmp_path / n}" for n in ("a.db", "b.db"))
    fill(src, "s", n_trials=2)
    assert invoke("db", "merge", "--from", src, "--db", dst).exit_code == 0
    out = []
    for url in (src, dst):
        r = invoke("stats", "sign-test", "--db", url, "--sweep", "s", "--where", "cell=e48",
                   "--format", "json")
        assert r.exit_code == 0, r.output
        d = json.loads(r.output)
        out.append({k: v for k, v in d.items() if k not in ("db",)})
    assert out[0] == out[1]


# ------------------------------------------------------------------ beside a live sweep,
# an older source, links to the target, a source's bytes (issue 40, item 4)

def sha(path) -> tuple[str, int] | None:
    """sha256 and mtime of a file; None when it does not exist."""
    import hashlib
    import os

    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest(), os.stat(path).st_mtime_ns


def files(path) -> dict[str, tuple[str, int] | None]:
    """The database file and its -wal and -shm, each as :func:`sha` gives it."""
    return {s: sha(f"{path}{s}") for s in ("", "-wal", "-shm")}


def make_running(url: str, sweep: str, *, heartbeat_s: float | None, age_s: float) -> None:
    """Sweep ``sweep`` with one trial ``running`` whose last heartbeat is ``age_s`` old."""
    from datetime import timedelta

    from qkgeom.store import open_store
    from qkgeom.store.base import now_utc
    from qkgeom.store.models import Trial

    with open_store(url) as store:
        sid = store.ensure_sweep(sweep, {"name": sweep}, "v", heartbeat_s=heartbeat_s)
        tid = store.ensure_trial(sid, "d2-gaussian-none-s0", {"seed": 0}, depth=2,
                                 init="gaussian", arm="none", seed=0)
        store.set_trial_status(tid, "running", bump_attempts=True)
        t = Trial.__table__
        at = now_utc() - timedelta(seconds=age_s)
        with store._write() as conn:
            conn.execute(t.update().where(t.c.id == tid)
                         .values(heartbeat_at=at, started_at=at))


def test_a_sqlite_target_with_a_live_sweep_is_refused_until_it_ends(tmp_path):
    """A merge holds a SQLite file's only write lock for its whole copy (~26 s for a
    million rows): into a database where a sweep runs (fresh heartbeat, or a running
    trial with no heartbeat interval: ``qkgeom train --db``) it is refused, naming the
    sweep and what to do, and nothing is written; a stale sweep (its driver gone) does not
    block it, and --beside-running merges anyway."""
    from qkgeom.store import open_store
    from qkgeom.store.liveness import live_sweeps

    src, dst = (f"sqlite:///{tmp_path / n}" for n in ("src.db", "dst.db"))
    fill(src, "cpu")
    make_running(dst, "live", heartbeat_s=15.0, age_s=5)  # a driver that beats
    make_running(dst, "train", heartbeat_s=None, age_s=3600)  # qkgeom train --db
    make_running(dst, "gone", heartbeat_s=15.0, age_s=200)  # no heartbeat for 200 s
    with open_store(dst, create=False, readonly=True) as store:
        assert live_sweeps(store) == ["live", "train"]
    before = counts(dst)
    r = invoke("db", "merge", "--from", src, "--db", dst)
    assert r.exit_code != 0, r.output
    assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1
    assert "holds a live sweep: 'live' (1 trial(s) running, last heartbeat 5s ago)" in r.output
    assert "'train' (1 trial(s) running, with no heartbeat interval recorded" in r.output
    assert "'gone'" not in r.output
    assert "Wait until it ends (qkgeom status --name live" in r.output
    assert "stop its driver" in r.output and "--beside-running" in r.output
    assert counts(dst) == before
    # the live sweeps end (or their drivers are gone): the same merge goes through
    with open_store(dst) as store:
        for name in ("live", "train"):
            store.mark_running_interrupted(store.require_sweep(name))
    r = invoke("db", "merge", "--from", src, "--db", dst)
    assert r.exit_code == 0, r.output
    assert rows(dst, "cpu") == rows(src, "cpu")
    # --beside-running: merged while a sweep runs
    make_running(dst, "live2", heartbeat_s=15.0, age_s=1)
    r = invoke("db", "merge", "--from", src, "--db", dst, "--rename", "cpu=cpu-2")
    assert r.exit_code != 0 and "'live2'" in r.output
    r = invoke("db", "merge", "--from", src, "--db", dst, "--rename", "cpu=cpu-2",
               "--beside-running")
    assert r.exit_code == 0, r.output
    assert rows(dst, "cpu-2") == rows(src, "cpu")


def test_a_sweep_that_starts_while_the_merge_waits_for_the_lock_is_seen(tmp_path):
    """The liveness check runs again inside the merge's write transaction: a writer that
    holds the lock while it starts a trial (committing after the merge's first check)
    gets the merge refused once the merge has the lock, and nothing is copied."""
    import subprocess
    import sys

    src, dst = (f"sqlite:///{tmp_path / n}" for n in ("src.db", "dst.db"))
    fill(src, "cpu")
    make_running(dst, "s", heartbeat_s=15.0, age_s=1)
    from qkgeom.store import open_store

    with open_store(dst) as store:
        store.mark_running_interrupted(store.require_sweep("s"))  # not live now
    before = counts(dst)
    code = (
        "import sqlite3, sys, time\n"
        "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
        "c.execute('BEGIN IMMEDIATE')\n"
        "c.execute(\"UPDATE trials SET status = 'running', heartbeat_at = "
        "strftime('%Y-%m-%d %H:%M:%f', 'now')\")\n"
        "print('locked', flush=True)\n"
        "time.sleep(3)\n"
        "c.execute('COMMIT')\n")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "dst.db")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        r = invoke("db", "merge", "--from", src, "--db", dst)
    finally:
        holder.wait(timeout=30)
    assert holder.returncode == 0
    assert r.exit_code != 0 and "holds a live sweep: 's' (1 trial(s) running" in r.output, \
        r.output
    assert counts(dst) == before


def test_a_postgresql_target_merges_beside_a_live_sweep(sqlite_url, pg_url):
    """PostgreSQL: the merge inserts the rows of new sweeps only and takes no lock that a
    sweep's writes need, so a live sweep does not block it (and keeps its rows)."""
    fill(sqlite_url, "cpu")
    make_running(pg_url, "live", heartbeat_s=15.0, age_s=1)
    before = rows(pg_url, "live")
    r = invoke("db", "merge", "--from", sqlite_url, "--db", pg_url)
    assert r.exit_code == 0, r.output
    assert rows(pg_url, "cpu") == rows(sqlite_url, "cpu")
    assert rows(pg_url, "live") == before


OLD = "0005_baseline_ref"


def old_source(url: str) -> None:
    """A database at revision 0005 (before heartbeats, attempts and cells) holding sweep
    ``old``: one finished trial with two probes, their metric rows, training steps and a
    checkpoint, written as that revision's qkgeom wrote them."""
    from sqlalchemy import create_engine, text

    from qkgeom.store.schema import upgrade

    upgrade(url, OLD)
    eng = create_engine(url)
    with eng.begin() as c:
        c.execute(text("INSERT INTO sweeps (id, name, spec, code_version, created_at) "
                       "VALUES (1, 'old', '{\"name\": \"old\"}', '0.0.5', "
                       "'2025-01-02 03:04:05')"))
        c.execute(text("INSERT INTO trials (id, sweep_id, trial_key, config, depth, init, arm, "
                       "seed, status, attempts, created_at, started_at, ended_at, test_loss) "
                       "VALUES (7, 1, 'd2-gaussian-none-s0', '{\"seed\": 0}', 2, 'gaussian', "
                       "'none', 0, 'terminated', 1, '2025-01-02 03:04:05', "
                       "'2025-01-02 03:04:06', '2025-01-02 04:00:00', 1.25)"))
        for step in (0, 10):
            c.execute(text("INSERT INTO probes (trial_id, step, progress, tokens, train_loss, "
                           "val_loss, lr, tokens_per_s) VALUES (7, :s, :p, :t, 2.5, 2.6, "
                           "0.001, 1000.0)"), {"s": step, "p": step / 10, "t": step * 512})
            for layer in (0, 1):
                c.execute(text("INSERT INTO probe_metrics (trial_id, step, layer, head_key, "
                               "metric, head, progress, value) VALUES (7, :s, :l, -1, "
                               "'pr_q', NULL, :p, :v)"),
                          {"s": step, "l": layer, "p": step / 10, "v": 1.0 + layer + step})
            c.execute(text("INSERT INTO train_steps (trial_id, step, train_loss, val_loss, lr, "
                           "tokens_per_s) VALUES (7, :s, 2.5, NULL, 0.001, 1000.0)"),
                      {"s": step})
        c.execute(text("INSERT INTO checkpoints (trial_id, step, location, created_at, kind) "
                       "VALUES (7, 10, '/runs/old/ckpt', '2025-01-02 04:00:00', 'resume')"))
    eng.dispose()


def test_an_older_sqlite_source_is_read_through_an_upgraded_copy_and_never_changed(tmp_path):
    """A source at revision 0005 is merged (it was refused with "run qkgeom db upgrade
    --db older.db", i.e. change the database --from promises not to change): read through
    a temporary copy upgraded to this qkgeom's schema, while the source file keeps every
    byte and its mtime, no -wal or -shm appears beside it, and it stays at 0005. Also
    with a killed writer's WAL beside it (its rows are in the copy; the WAL is kept)."""

    from qkgeom.store.schema import current

    path = tmp_path / "older.db"
    src, dst = f"sqlite:///{path}", f"sqlite:///{tmp_path / 'dst.db'}"
    old_source(src)
    before = files(path)
    assert before["-wal"] is None and before["-shm"] is None
    r = invoke("db", "merge", "--from", str(path), "--db", dst)
    assert r.exit_code == 0, r.output
    assert f"{src} is at schema revision {OLD}: read through a temporary copy" in r.output
    assert "copied sweep old: 1 trials (0 trial_attempts, 2 probes, 4 probe_metrics, " \
           "2 train_steps, 1 checkpoints)" in r.output
    assert files(path) == before
    assert current(src).current == (OLD,)
    got = rows(dst, "old")
    assert [t[0] for t in got["trials"]] == ["d2-gaussian-none-s0"]
    assert sorted(r[-1] for r in got["probe_metrics"]) == [1.0, 2.0, 11.0, 12.0]
    assert ["/runs/old/ckpt" in c for c in got["checkpoints"]] == [True]
    # a writer of that revision killed after a commit: its rows live in the -wal only
    killed_writer_renames(path)
    before = files(path)
    assert before["-wal"] is not None
    r = invoke("db", "merge", "--from", str(path), "--db", dst)
    assert r.exit_code == 0, r.output
    assert "copied sweep late: 1 trials" in r.output
    after = files(path)
    assert after[""] == before[""] and after["-wal"] == before["-wal"]


def test_an_older_postgresql_source_is_refused_with_the_ways_to_copy_it(pg_url, sqlite_url):
    """A PostgreSQL source at an older revision is refused (qkgeom copies only SQLite
    sources to upgrade them), naming the ways out; the source stays at its revision."""
    from qkgeom.store.schema import current

    old_source(pg_url)
    fill(sqlite_url, "cpu")
    before = counts(sqlite_url)
    r = invoke("db", "merge", "--from", pg_url, "--db", sqlite_url)
    assert r.exit_code != 0 and "Traceback" not in r.output
    assert f"has schema revision {OLD}, older than this qkgeom's" in r.output
    assert "does not copy a PostgreSQL database" in r.output and "pg_dump" in r.output
    assert current(pg_url).current == (OLD,)
    assert counts(sqlite_url) == before


def test_a_hard_link_or_a_symlink_to_the_target_is_the_same_database(tmp_path):
    """A hard link to the target (and a symlink to that link) is the target: refused like
    the same path, before anything is written; through a second path SQLite would keep a
    second -wal for the same file."""
    import os

    target = tmp_path / "m.db"
    url = f"sqlite:///{target}"
    fill(url, "s")
    before = counts(url), rows(url, "s")
    os.link(target, tmp_path / "hard.db")
    os.symlink(tmp_path / "hard.db", tmp_path / "sym.db")
    (tmp_path / "sub").mkdir()
    for other in ("hard.db", "sym.db", "sub/../hard.db"):
        for a, b in ((str(tmp_path / other), url), (url, str(tmp_path / other))):
            r = invoke("db", "merge", "--from", a, "--db", b, "--rename", "s=s2")
            assert r.exit_code != 0 and "the same database" in r.output, (a, b, r.output)
            assert (counts(url), rows(url, "s")) == before


@pytest.mark.parametrize("kind", ["wal", "wal-left-by-a-killed-writer", "rollback-journal"])
def test_reading_a_source_changes_none_of_its_bytes(kind, tmp_path):
    """``--from`` opens the source without switching it to WAL or changing any byte: the
    file's sha256 and mtime stay, no -wal or -shm is left that was not there, and a WAL a
    killed writer left is neither checkpointed into the file nor deleted."""
    import sqlite3

    path = tmp_path / "src.db"
    fill(f"sqlite:///{path}", "s")
    if kind == "rollback-journal":
        c = sqlite3.connect(path)
        assert c.execute("PRAGMA journal_mode=DELETE").fetchone() == ("delete",)
        c.close()
    if kind == "wal-left-by-a-killed-writer":
        killed_writer_renames(path)
    before = files(path)
    assert (before["-wal"] is not None) == (kind == "wal-left-by-a-killed-writer")
    r = invoke("db", "merge", "--from", str(path), "--db", str(tmp_path / "dst.db"))
    assert r.exit_code == 0, r.output
    name = "late" if kind == "wal-left-by-a-killed-writer" else "s"
    assert f"copied sweep {name}: 2 trials" in r.output
    after = files(path)
    assert after[""] == before[""] and after["-wal"] == before["-wal"]
    assert (after["-shm"] is None) == (before["-shm"] is None)


def test_a_report_across_databases_copies_running_sweeps_into_its_scratch_file(tmp_path):
    """``qkgeom report --compare SWEEP@DB`` copies sweeps as they are now, running trials
    too, into a scratch file of its own: a running sweep copied first does not make the
    next copy into that scratch file a merge beside a live sweep."""
    from qkgeom.store.merge import gathered

    base, other = (f"sqlite:///{tmp_path / n}" for n in ("base.db", "other.db"))
    fill(base, "a", running=True)  # one trial still running, heartbeat fresh
    fill(other, "b")
    with gathered(base, [("a", None), ("b", other)]) as (store, names):
        assert names == ["a", "b"]
        assert rows(store.url, "a") == rows(base, "a")
        assert rows(store.url, "b") == rows(other, "b")
