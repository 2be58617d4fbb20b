"""Heartbeats: a running trial whose driver is gone shows as stale, with how long, in
``qkgeom status`` (table and ``--json``) and on the live page; ``qkgeom sweep delete``
refuses a sweep whose trials still beat. A real driver killed with SIGKILL is reported
stale within the threshold (3 heartbeat intervals)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from datetime import datetime, timedelta, timezone

import pytest
from click.testing import CliRunner

from qkgeom.cli import main
from qkgeom.store import open_store
from qkgeom.store.lifecycle import STALE_AFTER, duration_text, no_heartbeat_s, stale_note

NOW = datetime(2026, 12, 5, 12, 0, 0, tzinfo=timezone.utc)


def cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_a_running_trial_is_stale_after_three_silent_intervals():
    ago = [NOW - timedelta(seconds=s) for s in (0, 29, 30, 31, 130)]
    assert STALE_AFTER == 3
    assert [no_heartbeat_s("running", t, None, 10.0, NOW) for t in ago] == \
        [None, None, None, 31.0, 130.0]
    # the start stands in for a heartbeat never written; naive datetimes are UTC
    assert no_heartbeat_s("running", None, NOW - timedelta(seconds=45), 10.0, NOW) == 45.0
    naive = (NOW - timedelta(seconds=45)).replace(tzinfo=None)
    assert no_heartbeat_s("running", naive, None, 10.0, NOW) == 45.0
    # only running trials, and only when the sweep promises heartbeats
    for status in ("pending", "terminated", "error", "interrupted"):
        assert no_heartbeat_s(status, ago[-1], None, 10.0, NOW) is None
    assert no_heartbeat_s("running", ago[-1], None, None, NOW) is None
    assert no_heartbeat_s("running", None, None, 10.0, NOW) is None
    assert [duration_text(s) for s in (0, 59.4, 130, 3725, float("inf"))] == \
        ["0s", "59s", "2m10s", "1h02m", "?"]
    assert stale_note(130, "x") == ("running, no heartbeat for 2m10s: the driver is gone? "
                                    "qkgeom sweep --resume --name x takes the sweep over and marks it "
                                    "interrupted")


def set_heartbeat(url: str, trial_id: int, when: datetime) -> None:
    from qkgeom.store.models import Trial

    t = Trial.__table__
    with open_store(url) as store, store.engine.begin() as conn:
        conn.execute(t.update().where(t.c.id == trial_id).values(heartbeat_at=when))


@pytest.fixture
def beating(db_url):
    """Sweep ``hb`` (heartbeats every 2 s): a trial silent for 130 s, a live one and a
    finished one; sweep ``quiet`` sends none (qkgeom train --db)."""
    with open_store(db_url) as store:
        sid = store.ensure_sweep("hb", {"name": "hb"}, "v", heartbeat_s=2.0)
        ids = {}
        for key, status in (("silent", "running"), ("live", "running"), ("done", "running")):
            ids[key] = store.ensure_trial(sid, key, {"max_steps": 20}, depth=1,
                                          init="gaussian", arm="none", seed=len(ids))
            store.set_trial_status(ids[key], status, bump_attempts=True)
        store.set_trial_status(ids["done"], "terminated")
        assert store.heartbeat(sid) == 3 - 1  # the running ones only
        qid = store.ensure_sweep("quiet", {"kind": "train"}, "v")
        quiet = store.ensure_trial(qid, "q", {}, depth=1, init="gaussian", arm="none", seed=0)
        store.set_trial_status(quiet, "running", bump_attempts=True)
    old = datetime.now(timezone.utc) - timedelta(seconds=130)
    for tid in (ids["silent"], ids["done"], quiet):
        set_heartbeat(db_url, tid, old)
    return db_url, ids


def test_status_and_the_live_page_show_a_stale_trial(beating):
    url, ids = beating
    r = cli("status", "--name", "hb", "--db", url, "--json")
    assert r.exit_code == 0, r.output
    rows = {x["trial"]: x for x in json.loads(r.output)}
    assert rows["silent"]["stale"] is True and 130 <= rows["silent"]["no_heartbeat_s"] < 140
    assert rows["silent"]["note"].startswith("running, no heartbeat for 2m1")
    assert rows["silent"]["note"].endswith("qkgeom sweep --resume --name hb takes the sweep "
                                           "over and marks it interrupted")
    assert rows["silent"]["status"] == "running"  # the record is unchanged
    for key in ("live", "done"):
        assert rows[key]["stale"] is False and rows[key]["no_heartbeat_s"] is None
        assert rows[key]["note"] == "" and rows[key]["heartbeat_at"]
    table = cli("status", "--name", "hb", "--db", url).output
    line = next(ln for ln in table.splitlines() if ln.startswith("silent"))
    assert "running, no heartbeat for 2m1" in line and "the driver is gone?" in line
    assert table.rstrip().endswith("2 running (1 stale: no heartbeat), 1 terminated")
    quiet = json.loads(cli("status", "--name", "quiet", "--db", url, "--json").output)
    assert quiet[0]["stale"] is False  # no interval promised: never judged

    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from qkgeom.web.serve import create_app

    with TestClient(create_app(url, wait_s=0, update_every_s=0),
                    base_url="http://127.0.0.1") as client:
        page = client.get("/sweeps/hb").text
    assert "1 running without a heartbeat: the driver is gone?" in page
    silent = next(r for r in page.split("<tr>") if "<td>silent</td>" in r)
    assert "<td class='s-stale'>running (stale)</td>" in silent
    assert "running, no heartbeat for 2m1" in silent
    live = next(r for r in page.split("<tr>") if "<td>live</td>" in r)
    assert "s-running" in live and "stale" not in live


def test_delete_refuses_a_sweep_whose_trials_still_beat(beating):
    url, ids = beating
    r = cli("sweep", "delete", "--name", "hb", "--db", url, "--yes")
    out = r.output.strip().splitlines()
    assert r.exit_code == 1 and out[-1].startswith(
        "Error: sweep hb may be running: 'hb' (1 trial(s) running, last heartbeat")
    assert "stop its driver first" in out[-1]
    assert any("2 trial(s) are recorded as running" in ln for ln in out)
    with open_store(url, create=False, readonly=True) as store:
        assert store.sweep_id("hb") is not None
    set_heartbeat(url, ids["live"], datetime.now(timezone.utc) - timedelta(seconds=60))
    r = cli("sweep", "delete", "--name", "hb", "--db", url, "--yes")
    assert r.exit_code == 0 and "their driver is provably gone" in r.output
    assert "deleted sweep hb: 3 trials" in r.output


def _status(db: str, scratch) -> list[dict]:
    from sweep_fixtures import run_cli

    p = run_cli(["status", "--name", "beat", "--db", db, "--json"], scratch, check=False)
    return json.loads(p.stdout) if p.returncode == 0 else []


@pytest.mark.ray
def test_a_sigkilled_driver_is_reported_stale_within_the_threshold(wikitext_dir):
    import shutil
    import tempfile
    from pathlib import Path

    from sweep_fixtures import QKGEOM, cli_env

    every = 2.0
    scratch = Path(tempfile.mkdtemp(prefix="qkhb-", dir="/tmp"))
    db = f"{scratch}/beat.db"
    cmd = [QKGEOM, "sweep", "--preset", "smoke", "--name", "beat", "--db", db,
           "--data", str(wikitext_dir), "--progress-every", "60", "--heartbeat-every",
           str(every)]
    # one probe at step 0, the next far later: between results only the driver's periodic
    # heartbeat (Tune's on_step_begin) keeps the trials fresh
    for s in ("max_steps=100000", "probe_every=50000", "grid.depths=[1]",
              "grid.inits=[gaussian]", "grid.seeds=1", "interventions.depth=1",
              "interventions.seeds=[0]", "interventions.arms=[hold]"):
        cmd += ["--set", s]
    log = open(scratch / "driver.log", "w")
    proc = subprocess.Popen(cmd, env=cli_env(scratch), stdout=log, stderr=subprocess.STDOUT,
                            cwd=scratch, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:  # both trials running and reporting, their heartbeats fresh
            rows = _status(db, scratch)
            run = [r for r in rows if r["status"] == "running" and r["step"] is not None]
            if len(run) == 2:
                break
            assert proc.poll() is None, (scratch / "driver.log").read_text()
            assert time.monotonic() < deadline, (scratch / "driver.log").read_text()
            time.sleep(0.5)
        time.sleep(2 * STALE_AFTER * every)  # no result comes now, the heartbeats do
        rows = _status(db, scratch)
        run = [r for r in rows if r["status"] == "running"]
        assert len(run) == 2 and not any(r["stale"] for r in run), run
        assert all(r["step"] == 0 for r in run), run  # no probe since the first
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        proc.wait()
        try:  # the driver's local Ray shares its session: end it too
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        # within the threshold (3 intervals) of the kill, status calls them stale
        time.sleep(max(0.0, killed + STALE_AFTER * every + 0.5 - time.monotonic()))
        rows = {r["trial"]: r for r in _status(db, scratch)}
        stale = [r for r in rows.values() if r["status"] == "running"]
        assert stale and all(r["stale"] for r in stale), rows
        assert all(STALE_AFTER * every < r["no_heartbeat_s"] <= STALE_AFTER * every + 30
                   for r in stale), stale
        assert all("the driver is gone?" in r["note"] for r in stale)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
        shutil.rmtree(scratch, ignore_errors=True)
