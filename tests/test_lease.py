"""Issue 40, item 2: one driver per sweep.

The lease (``sweep_leases``, :mod:`qkgeom.store.lease`) is taken with the database's own
clock; ``qkgeom sweep --resume`` refuses while a live driver holds it (naming it, saying
how to take over), takes over a lease whose pid is dead on this host or whose heartbeat
is stale, and of two drivers at once exactly one wins. Real processes, SQLite and
PostgreSQL.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
from datetime import timedelta

import pytest
from sweep_fixtures import run_cli
from test_delete_safety import HOLD

from qkgeom.store import open_store

SPEC = """name: ls
trial: {preset: smoke, overrides: {max_steps: 20, probe_every: 10, eval_every: 10}}
grid: {depths: [1], inits: [gaussian], seeds: 1}
"""


def recorded_sweep(url: str, tmp_path, data, *, running: bool = False) -> int:
    """Sweep ``ls`` as a first run records it (spec, trial, no lease), optionally with its
    one trial left ``running``. Returns its id."""
    from qkgeom.plan.spec import plan_from
    from qkgeom.sweeps.resume import prepare_db

    (tmp_path / "spec.yaml").write_text(SPEC)
    plan = plan_from(None, str(tmp_path / "spec.yaml"), name=None, data=str(data), sets=())
    sid, _, _ = prepare_db(plan, url, resume=False, threads=1)
    if running:
        with open_store(url) as store:
            tid = store.trial_id(sid, plan.trials[0].key)
            store.set_trial_status(tid, "running", bump_attempts=True)
    return sid


def holder(url: str, name: str = "ls") -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLD, url, name], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def _race(url: str, sid: int, barrier, out) -> None:
    from qkgeom.store.lease import LeaseHeld, acquire

    with open_store(url, create=False) as store:
        barrier.wait()
        try:
            acquire(store, sid, "ls", stale_after_s=60.0)
            out.put(("won", os.getpid()))
        except LeaseHeld as e:
            out.put(("refused", str(e)))


def test_of_two_drivers_at_once_exactly_one_wins(db_url, tmp_path, wikitext_dir):
    sid = recorded_sweep(db_url, tmp_path, wikitext_dir)
    ctx = mp.get_context("spawn")
    for _ in range(3):
        with open_store(db_url) as store, store._write() as conn:
            conn.exec_driver_sql("DELETE FROM sweep_leases")
        barrier, out = ctx.Barrier(2), ctx.Queue()
        procs = [ctx.Process(target=_race, args=(db_url, sid, barrier, out)) for _ in range(2)]
        for p in procs:
            p.start()
        got = sorted(out.get(timeout=60) for _ in procs)
        for p in procs:
            p.join(timeout=60)
        assert [g[0] for g in got] == ["refused", "won"], got
        winner = got[1][1]
        # the loser names the winner (or, on PostgreSQL, says it lost the insert race)
        assert f"pid {winner}" in got[0][1] or "a moment ago" in got[0][1], got


def test_resume_refuses_beside_a_live_driver_and_changes_nothing(db_url, tmp_path,
                                                                 wikitext_dir):
    """On main a resume marked every running trial interrupted with no liveness check,
    so a second driver would run beside the live one."""
    recorded_sweep(db_url, tmp_path, wikitext_dir, running=True)
    h = holder(db_url)
    try:
        p = run_cli(["sweep", "--resume", "--name", "ls", "--db", db_url, "--data",
                     str(wikitext_dir)], tmp_path, check=False)
        out = (p.stdout + p.stderr).strip()
        assert p.returncode == 1, out
        assert f"sweep ls is being run by another driver: pid {h.pid} on " \
            f"{socket.gethostname()} (test holder)" in out, out
        assert f"kill {h.pid}" in out and "qkgeom sweep --resume --name ls takes over" in out
        with open_store(db_url, create=False, readonly=True) as store:
            assert store.trials("ls")["status"].to_list() == ["running"]  # not interrupted
        # status says the driver is alive, not "gone? --resume"
        from qkgeom.cli.sweep import status_rows
        from qkgeom.store.lifecycle import stale_note

        with open_store(db_url, create=False, readonly=True) as store:
            from qkgeom.store.lease import read_lease

            lease = read_lease(store, store.require_sweep("ls"))
        note = stale_note(200, "ls", lease)
        assert "it is alive; wait" in note and "--resume" not in note
        assert status_rows(db_url, "ls")[0]["status"] == "running"
        text = run_cli(["status", "--name", "ls", "--db", db_url], tmp_path).stdout
        assert text.strip().splitlines()[-1].startswith(
            f"driver: pid {h.pid} on {socket.gethostname()} (test holder), last heartbeat ")
        assert text.strip().endswith("by the database's clock: live"), text
    finally:
        h.stdin.close()
        h.wait(timeout=30)


@pytest.mark.ray
def test_a_killed_drivers_lease_is_taken_over_on_its_host(sqlite_url, tmp_path,
                                                          wikitext_dir):
    """A driver SIGKILLed holding the lease: on the same host its dead pid is proof, so
    the resume takes over at once (no wait for staleness), marks its trial interrupted and
    finishes the sweep; the lease is released at the end."""
    recorded_sweep(sqlite_url, tmp_path, wikitext_dir, running=True)
    h = holder(sqlite_url)
    h.send_signal(signal.SIGKILL)
    h.wait(timeout=30)
    p = run_cli(["sweep", "--resume", "--name", "ls", "--db", sqlite_url, "--data",
                 str(wikitext_dir), "--progress-every", "60"], tmp_path)
    assert f"took over sweep ls from its earlier driver (pid {h.pid} on " \
        f"{socket.gethostname()}: pid {h.pid} no longer runs" in p.stdout, p.stdout
    assert "marked 1 trial(s) left running by a dead driver as interrupted" in p.stdout
    with open_store(sqlite_url, create=False, readonly=True) as store:
        assert store.trials("ls")["status"].to_list() == ["terminated"]
        assert store.sql("SELECT count(*) AS n FROM sweep_leases")["n"][0] == 0


def test_a_lease_elsewhere_is_taken_over_only_once_stale_by_the_databases_clock(
        db_url, tmp_path, wikitext_dir):
    """A lease of another host: refused while its heartbeat is fresh (saying after how
    long it may be taken), taken once it is older than its ``stale_after_s`` by the
    database's clock."""
    import sqlalchemy as sa

    from qkgeom.store.lease import LeaseHeld, acquire, db_now

    sid = recorded_sweep(db_url, tmp_path, wikitext_dir)
    with open_store(db_url) as store:
        with store._write() as conn:
            now = db_now(conn)
            conn.execute(sa.text(
                "INSERT INTO sweep_leases (sweep_id, token, host, pid, command, taken_at, "
                "heartbeat_at, stale_after_s) VALUES (:s, 'x', 'elsewhere', 1, NULL, :t, :t, "
                "90)"), {"s": sid, "t": now - timedelta(seconds=60)})
        with pytest.raises(LeaseHeld, match=r"pid 1 on elsewhere.*last heartbeat 6\d s ago.*"
                                            r"kill 1 there.*after 90 s without a heartbeat"):
            acquire(store, sid, "ls", stale_after_s=90)
        with store._write() as conn:
            conn.execute(sa.text("UPDATE sweep_leases SET heartbeat_at = :t"),
                         {"t": db_now(conn) - timedelta(seconds=100)})
        token, old = acquire(store, sid, "ls", stale_after_s=90)
        assert old.host == "elsewhere" and "no heartbeat for 10" in old.gone()
        assert store.sql("SELECT token, pid FROM sweep_leases").rows() == [(token,
                                                                             os.getpid())]


def test_a_driver_whose_lease_was_taken_over_knows_it(sqlite_url, tmp_path, wikitext_dir):
    """The keeper's renewal fails once another driver holds the lease: ``lost`` is set and
    its hook runs (the driver then stops without marking the other's trials)."""
    import threading

    from qkgeom.store.lease import LeaseKeeper, acquire

    sid = recorded_sweep(sqlite_url, tmp_path, wikitext_dir)
    with open_store(sqlite_url) as store:
        token, _ = acquire(store, sid, "ls", stale_after_s=60)
    fired = threading.Event()
    keeper = LeaseKeeper(sqlite_url, sid, token, 0.1, on_lost=fired.set).start()
    try:
        with open_store(sqlite_url) as store, store._write() as conn:
            conn.exec_driver_sql("UPDATE sweep_leases SET token = 'another'")
        assert fired.wait(10) and keeper.lost
    finally:
        keeper.stop()
    with open_store(sqlite_url, create=False, readonly=True) as store:
        assert store.sql("SELECT token FROM sweep_leases")["token"].to_list() == ["another"]
