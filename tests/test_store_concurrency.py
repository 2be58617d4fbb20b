"""Two processes writing different trials into one new SQLite file at the same time."""

from __future__ import annotations

import multiprocessing as mp

from helpers import writer_process

from qkgeom.store import open_store

N_PROBES = 300  # per process; 2 layers x (9 per-head metrics x 3 + 1) = 56 values each


def test_two_processes_one_sqlite_file(tmp_path):
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    ctx = mp.get_context("spawn")  # no fork of the test process's state
    q = ctx.Queue()
    procs = [ctx.Process(target=writer_process, args=(url, key, N_PROBES, q))
             for key in ("left", "right")]
    for p in procs:
        p.start()  # both open the brand-new file: creation itself races too
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    errors = [(k, e) for k, _, e in results if e]
    assert not errors, errors
    written = {k: n for k, n, _ in results}
    with open_store(url) as store:
        df = store.sql("SELECT t.trial_key, COUNT(*) AS n, COUNT(DISTINCT m.step) AS steps "
                       "FROM probe_metrics m JOIN trials t ON t.id = m.trial_id "
                       "GROUP BY t.trial_key ORDER BY t.trial_key")
        assert df.rows() == [("left", written["left"], N_PROBES),
                             ("right", written["right"], N_PROBES)]
        assert int(store.sql("SELECT COUNT(*) FROM probes").item()) == 2 * N_PROBES
        assert store.trials()["status"].to_list() == ["terminated", "terminated"]
        assert int(store.sql("SELECT COUNT(*) FROM sweeps").item()) == 1


def _other_process_reads(path, sql: str):
    """Open ``path`` in a fresh process, run ``sql``, close: the close checkpoints and
    deletes the WAL if that process thinks it holds the last connection."""
    import subprocess
    import sys

    code = ("import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); "
            "print(c.execute(sys.argv[2]).fetchone()[0]); c.close()")
    out = subprocess.run([sys.executable, "-c", code, str(path), sql], check=True,
                         capture_output=True, text=True).stdout
    return int(out)


def test_a_second_open_keeps_the_first_connections_locks(tmp_path):
    """Opening the database again in a process that already has it open (the sweep driver
    does: its writer plus the status reads) must not drop that process's SQLite locks.

    Before the fix the file's header was read with a plain open()/close(), which releases
    every POSIX lock the process holds on the file: another process's next close then
    checkpointed and deleted the WAL under the writer, and the writer's later commits went
    to the deleted WAL, invisible to every other process (found as a CI failure: a sweep
    driver could not find its own trial row).
    """
    path = tmp_path / "held.db"
    url = f"sqlite:///{path}"
    with open_store(url) as writer:
        sid = writer.ensure_sweep("s", {"name": "s"}, "v")
        writer.ensure_trial(sid, "a", {}, depth=1, init="gaussian", arm="none", seed=0)
        with open_store(url, create=False, readonly=True) as again:  # the second open
            assert again.trial_id(sid, "a") is not None
        assert _other_process_reads(path, "SELECT COUNT(*) FROM trials") == 1
        assert (tmp_path / "held.db-wal").exists()  # the writer's WAL was left alone
        writer.ensure_trial(sid, "b", {}, depth=1, init="orthogonal", arm="none", seed=0)
        # a commit after the other process's close is visible to a third process
        assert _other_process_reads(path, "SELECT COUNT(*) FROM trials") == 2
    assert _other_process_reads(path, "SELECT COUNT(*) FROM trials") == 2


def test_creating_a_database_keeps_the_creators_locks(tmp_path):
    """The path of the CI failure: ``open_store`` on a new file connects, finds it empty
    and migrates it through a second engine, then goes on writing through the first."""
    path = tmp_path / "new.db"
    url = f"sqlite:///{path}"
    with open_store(url) as creator:  # creates and migrates the file
        sid = creator.ensure_sweep("s", {"name": "s"}, "v")
        creator.ensure_trial(sid, "a", {}, depth=1, init="gaussian", arm="none", seed=0)
        assert _other_process_reads(path, "SELECT COUNT(*) FROM trials") == 1
        creator.ensure_trial(sid, "b", {}, depth=1, init="orthogonal", arm="none", seed=0)
        assert _other_process_reads(path, "SELECT COUNT(*) FROM trials") == 2
