"""A writer waits out a database that another writer keeps locked, instead of failing
(issue 40, item 4): a ``qkgeom db merge`` beside a live sweep holds SQLite's write lock
for its whole copy (~26 s for a million rows), past the 30 s busy timeout for a larger
one, and the sweep's driver and ``qkgeom train --db`` must at worst be delayed by it.

Real processes on real files: the test holds the write lock (``BEGIN IMMEDIATE``, as the
merge does) past a busy timeout shortened to 0.5 s (``$QKGEOM_BUSY_TIMEOUT_S``), and the
writer, in its own process, writes through :class:`qkgeom.store.recorder.TrialRecorder`
(what the sweep driver's ``DbWriter`` and ``qkgeom train --db`` write through) or is
``qkgeom train --db`` itself. On PostgreSQL the lock is a table lock held past a
``lock_timeout`` that the writer's URL sets.
"""

from __future__ import annotations

import os
import queue
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

from helpers import make_record

from qkgeom.store import open_store

TESTS = Path(__file__).resolve().parent
WAITING = "database locked by another writer for"

WRITER = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
from helpers import make_record
from qkgeom.store import open_store
from qkgeom.store.recorder import TrialRecorder

with open_store(sys.argv[1], create=False) as store:
    sid = store.require_sweep("s")
    tid = store.trial_id(sid, "k")
    rec = TrialRecorder(store, sid)
    rec.started(tid, {{"host": "h"}})
    for step in (0, 5, 10):
        rec.reported(tid, make_record(step, n_layer=2, n_head=2, history=2),
                     saved=f"/ckpt/{{step}}", kind="resume")
    rec.result(tid, test_loss=1.5)
    rec.finished(tid)
print("written", flush=True)
"""


def seed(url: str) -> None:
    """Sweep ``s`` with one pending trial ``k``."""
    with open_store(url) as store:
        sid = store.ensure_sweep("s", {"name": "s"}, "v", heartbeat_s=15.0)
        store.ensure_trial(sid, "k", {"seed": 0}, depth=2, init="gaussian", arm="none",
                           seed=0)


def stored(url: str) -> tuple:
    with open_store(url, create=False, readonly=True) as store:
        t = store.trials("s").row(0, named=True)
        n = int(store.sql("SELECT COUNT(*) FROM probes").item())
        ck = sorted(store.sql("SELECT step FROM checkpoints")["step"].to_list())
        return t["status"], t["attempts"], n, ck


def start(args: list[str], **env: str) -> tuple[subprocess.Popen, queue.Queue]:
    """A process whose stderr lines arrive in a queue (None at its end)."""
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, **env})
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in p.stderr:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return p, lines


def wait_for(lines: queue.Queue, text: str, timeout: float) -> list[str]:
    """Lines until one containing ``text``; fails when the process ends or time runs out."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
        except queue.Empty:
            raise AssertionError(f"no {text!r} line in {timeout} s; stderr: {seen}") from None
        if line is None:
            raise AssertionError(f"the process ended without a {text!r} line: {seen}")
        seen.append(line)
        if text in line:
            return seen


def hold(path: Path) -> sqlite3.Connection:
    """The write lock of ``path``, taken as a merge takes it (BEGIN IMMEDIATE)."""
    c = sqlite3.connect(path, isolation_level=None)
    c.execute("BEGIN IMMEDIATE")
    return c


def test_a_writer_waits_out_a_lock_held_past_the_busy_timeout(tmp_path):
    """The writer meets the lock on its first write, says so every busy timeout, and its
    rows land once the lock is released: it never fails."""
    path = tmp_path / "r.db"
    url = f"sqlite:///{path}"
    seed(url)
    held = hold(path)
    t0 = time.monotonic()
    try:
        p, lines = start([sys.executable, "-c", WRITER, url], QKGEOM_BUSY_TIMEOUT_S="0.5")
        wait_for(lines, WAITING, timeout=60)
        wait_for(lines, WAITING, timeout=5)  # again, one busy timeout later
        assert p.poll() is None  # still waiting, not failed
    finally:
        held.execute("COMMIT")
        held.close()
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 0 and out.strip() == "written", out
    assert time.monotonic() - t0 > 1.0  # it did wait past two busy timeouts
    assert stored(url) == ("terminated", 1, 3, [0, 5, 10])


def test_a_writer_gives_up_after_the_bound_saying_what_to_do(tmp_path):
    """Past ``$QKGEOM_LOCK_WAIT_S`` the write fails in one line that names the bound and
    what to do; the transaction that waited stored nothing."""
    path = tmp_path / "r.db"
    url = f"sqlite:///{path}"
    seed(url)
    held = hold(path)
    try:
        p, lines = start([sys.executable, "-c", WRITER, url], QKGEOM_BUSY_TIMEOUT_S="0.3",
                         QKGEOM_LOCK_WAIT_S="1")
        p.wait(timeout=60)
    finally:
        held.execute("COMMIT")
        held.close()
    err = []
    while (line := lines.get(timeout=10)) is not None:
        err.append(line)
    text = "".join(err)
    assert p.returncode != 0
    assert WAITING in text
    assert ("stayed locked by another writer longer than qkgeom waits (1 s, "
            "$QKGEOM_LOCK_WAIT_S)") in text and "End what holds the lock" in text
    assert stored(url) == ("pending", 0, 0, [])


def test_a_bad_busy_timeout_is_refused_with_what_to_give(tmp_path):
    from helpers import invoke

    url = f"sqlite:///{tmp_path / 'r.db'}"
    seed(url)
    r = invoke("db", "current", "--db", url, env={"QKGEOM_BUSY_TIMEOUT_S": "soon"})
    assert r.exit_code != 0 and "Traceback" not in r.output
    assert "$QKGEOM_BUSY_TIMEOUT_S='soon': give a number of seconds > 0" in r.output


def test_qkgeom_train_db_waits_out_a_locked_database(wikitext_dir, tmp_path):
    """``qkgeom train --db`` started while another writer holds the lock past the busy
    timeout: it waits, says so, then trains and records the whole trial."""
    path = tmp_path / "r.db"
    url = f"sqlite:///{path}"
    seed(url)  # the database exists (at head); the train run's first write meets the lock
    held = hold(path)
    try:
        p, lines = start([sys.executable, "-c", "from qkgeom.cli import main; main()",
                          "train", "--preset", "smoke", "--data", str(wikitext_dir),
                          "--quiet", "--db", url, "--out", str(tmp_path / "run")],
                         QKGEOM_BUSY_TIMEOUT_S="0.5")
        wait_for(lines, WAITING, timeout=120)
        assert p.poll() is None
    finally:
        held.execute("COMMIT")
        held.close()
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out
    with open_store(url, create=False, readonly=True) as store:
        t = store.trials("train").row(0, named=True)
        assert (t["status"], t["attempts"]) == ("terminated", 1)
        assert int(store.sql("SELECT COUNT(*) FROM probes").item()) == 3


def test_a_postgresql_writer_waits_out_a_table_lock_past_its_lock_timeout(pg_url):
    """PostgreSQL: a writer whose URL (or server) sets a short ``lock_timeout`` waits out a
    table lock held longer than that (up to ``$QKGEOM_LOCK_WAIT_S``) instead of failing."""
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url

    seed(pg_url)
    u = make_url(pg_url)
    short = u.update_query_dict({"options": f"{u.query['options']} -c lock_timeout=300"})
    short_url = short.render_as_string(hide_password=False)
    eng = create_engine(pg_url)
    conn = eng.connect()
    tx = conn.begin()
    conn.exec_driver_sql("LOCK TABLE probe_metrics IN ACCESS EXCLUSIVE MODE")
    try:
        p, lines = start([sys.executable, "-c", WRITER, short_url])
        time.sleep(2.5)  # > 8 lock timeouts of the writer's URL
        assert p.poll() is None, p.communicate()
    finally:
        tx.commit()
        conn.close()
        eng.dispose()
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0 and out.strip() == "written", (out, err)
    assert stored(pg_url) == ("terminated", 1, 3, [0, 5, 10])


def test_the_written_rows_equal_an_unlocked_run(tmp_path):
    """What a writer that waited stored equals what one that did not wait stores."""
    a, b = tmp_path / "a.db", tmp_path / "b.db"
    for path in (a, b):
        seed(f"sqlite:///{path}")
    subprocess.run([sys.executable, "-c", WRITER, f"sqlite:///{a}"], check=True,
                   capture_output=True)
    held = hold(b)
    try:
        p, lines = start([sys.executable, "-c", WRITER, f"sqlite:///{b}"],
                         QKGEOM_BUSY_TIMEOUT_S="0.3")
        wait_for(lines, WAITING, timeout=60)
    finally:
        held.execute("COMMIT")
        held.close()
    p.communicate(timeout=60)
    assert p.returncode == 0
    q = ("SELECT step, layer, head_key, metric, value FROM probe_metrics "
         "ORDER BY step, layer, head_key, metric")
    with open_store(f"sqlite:///{a}", create=False) as sa, \
            open_store(f"sqlite:///{b}", create=False) as sb:
        assert sa.sql(q).rows() == sb.sql(q).rows()
        assert len(sa.sql(q)) == 3 * len(make_record(0, n_layer=2, n_head=2).metrics)


LIVE_WRITER = f"""
import sys, threading, time
sys.path.insert(0, {str(TESTS)!r})
from helpers import make_record
from qkgeom.store import open_store
from qkgeom.store.recorder import TrialRecorder

stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
with open_store(sys.argv[1], create=False) as store:
    sid = store.require_sweep("s")
    tid = store.trial_id(sid, "k")
    rec = TrialRecorder(store, sid)
    rec.started(tid, {{"host": "h"}})
    print("started", flush=True)
    step = 0
    while not stop.is_set():
        rec.reported(tid, make_record(step, n_layer=2, n_head=2, history=2))
        step += 1
        time.sleep(0.02)
    rec.finished(tid)
print(step, flush=True)
"""


def test_a_real_merge_beside_a_writing_sweep_only_delays_its_writes(tmp_path):
    """The row of issue 40: ``qkgeom db merge --beside-running`` of ~80,000 metric rows
    into the SQLite file a live trial is writing, the merge holding the write lock past
    the writer's (shortened) busy timeout. The writer waits, says so, and never fails;
    every probe it wrote and every merged row are stored."""
    src, dst = f"sqlite:///{tmp_path / 'src.db'}", f"sqlite:///{tmp_path / 'dst.db'}"
    with open_store(src) as store:
        sid = store.ensure_sweep("big", {"name": "big"}, "v")
        for k in range(2):
            tid = store.ensure_trial(sid, f"k{k}", {}, depth=8, init="gaussian", arm="none",
                                     seed=k)
            store.write_probes(tid, [make_record(s, n_layer=8, n_head=8) for s in range(60)])
            store.set_trial_status(tid, "terminated")
        expected = store.sweep_row_counts("big")
    seed(dst)
    env = {"QKGEOM_BUSY_TIMEOUT_S": "0.2"}
    w = subprocess.Popen([sys.executable, "-c", LIVE_WRITER, dst], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, **env})
    try:
        assert w.stdout.readline().strip() == "started"
        m = subprocess.run([sys.executable, "-c", "from qkgeom.cli import main; main()",
                            "db", "merge", "--from", src, "--db", dst, "--beside-running"],
                           capture_output=True, text=True, env={**os.environ, **env},
                           timeout=300)
        assert m.returncode == 0, m.stdout + m.stderr
        assert w.poll() is None  # still writing: not failed
    finally:
        out, err = w.communicate(input="stop", timeout=120)
    assert w.returncode == 0, err
    assert WAITING in err  # the merge held the lock past the busy timeout: it waited
    probes = int(out.strip().splitlines()[-1])
    with open_store(dst, create=False, readonly=True) as store:
        assert store.sweep_row_counts("big") == expected
        assert int(store.sql("SELECT COUNT(*) FROM probes p JOIN trials t ON t.id = "
                             "p.trial_id WHERE t.trial_key = 'k'").item()) == probes
        assert store.trials("s")["status"].to_list() == ["terminated"]
