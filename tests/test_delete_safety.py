"""Issue 40, item 1: ``qkgeom sweep delete`` deletes only what it can prove is the sweep's.

Each test plants a sweep whose recorded locations point somewhere they should not (the
working directory, HOME, system directories, symlinks out of the storage, a merged
origin's files), puts decoy files there, runs the real command with ``--yes`` and checks
by sha256 that every decoy survives (system paths themselves only with ``--dry-run``).
SQLite and PostgreSQL where the database matters; real files and real processes.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_sweep_files import cli, plant_sweep, tree

from qkgeom.store import open_store
from qkgeom.sweeps.files import STORAGE_KEY

OWNER_STAMP = ".qkgeom-owner.json"  # qkgeom.sweeps.files.OWNER_STAMP


def stamp_directory(loc: str, identity: str, sweep: str) -> None:
    from qkgeom.sweeps import files

    files.stamp_directory(loc, identity, sweep)


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def decoys(d: Path) -> dict[str, str]:
    """Plant a few files (one nested) in ``d``; their sha256 by path."""
    (d / "sub").mkdir(parents=True, exist_ok=True)
    (d / "precious.txt").write_text(f"do not delete {d}")
    (d / "sub" / "data.bin").write_bytes(os.urandom(256))
    return tree(d)


def one_location_sweep(store, name: str, location: str, storage: Path | None = None) -> None:
    sid = store.ensure_sweep(name, {"name": name, **({STORAGE_KEY: str(storage)}
                                                     if storage else {})}, "v")
    tid = store.ensure_trial(sid, "d1-gaussian-none-s0", {"max_steps": 20}, depth=1,
                             init="gaussian", arm="none", seed=0, status="terminated")
    store.add_checkpoint(tid, 10, location, kind="resume")


@pytest.mark.parametrize("where", ["cwd", "home"])
def test_the_working_directory_and_home_are_never_deleted(db_url, tmp_path, monkeypatch,
                                                           where):
    """Recorded locations ``.`` and ``~`` (HOME pointed at a scratch directory): deleted
    with their contents on main; kept now, with the reason."""
    target = tmp_path / where
    target.mkdir()
    files = decoys(target)
    monkeypatch.chdir(target if where == "cwd" else tmp_path)
    if where == "home":
        monkeypatch.setenv("HOME", str(target))
    with open_store(db_url) as store:
        one_location_sweep(store, "bad", "." if where == "cwd" else "~")
    r = cli("sweep", "delete", "--name", "bad", "--db", db_url, "--yes")
    assert r.exit_code == 0, r.output
    what = "the working directory" if where == "cwd" else "HOME"
    assert f"is or contains {what}" in r.output and "removed 0 path(s)" in r.output
    assert tree(target) == files
    with open_store(db_url, create=False, readonly=True) as store:
        assert store.sweep_names() == []  # the rows went


def test_system_directories_are_never_listed_for_deletion(db_url, tmp_path):
    """``/usr/share/doc`` and ``file:///etc`` (dry run only), and a decoy of the same
    shape (a directory not named like a checkpoint, with no ownership stamp) with --yes."""
    decoy = tmp_path / "share" / "doc"
    decoy.mkdir(parents=True)
    files = decoys(decoy)
    with open_store(db_url) as store:
        one_location_sweep(store, "sys", "/usr/share/doc")
        sid = store.require_sweep("sys")
        tid = store.trial_id(sid, "d1-gaussian-none-s0")
        store.add_checkpoint(tid, 20, "file:///etc", kind="snapshot")
        one_location_sweep(store, "decoy", str(decoy))
    r = cli("sweep", "delete", "--name", "sys", "--db", db_url, "--dry-run")
    assert r.exit_code == 0, r.output
    assert "files: 0 path(s), 0 bytes" in r.output, r.output
    assert "kept: /usr/share/doc (" in r.output and "kept: file:///etc (" in r.output
    r = cli("sweep", "delete", "--name", "decoy", "--db", db_url, "--yes")
    assert r.exit_code == 0, r.output
    assert f"kept: {decoy} (not a directory qkgeom made for this sweep" in r.output
    assert tree(decoy) == files


def test_a_symlink_is_removed_as_a_link_never_its_target(db_url, tmp_path):
    """An experiment directory and a checkpoint that are symlinks to directories outside
    the storage: the links go, the targets stay byte for byte."""
    storage, outside = tmp_path / "ray", tmp_path / "elsewhere"
    with open_store(db_url) as store:
        plant_sweep(store, "ln", storage, ["qkgeom-ln-arms"])
        (outside / "exp").mkdir(parents=True)
        files = {"exp": decoys(outside / "exp")}
        os.symlink(outside / "exp", storage / "qkgeom-ln")  # the main experiment: a link
        (outside / "ckpt").mkdir()
        files["ckpt"] = decoys(outside / "ckpt")
        link = tmp_path / "runs" / "checkpoints" / "step_0000020"  # as train --db's, stamped
        link.parent.mkdir(parents=True)
        from qkgeom.store.lease import database_identity

        stamp_directory(str(link.parent), database_identity(store), "ln")
        os.symlink(outside / "ckpt", link)
        tid = store.trial_id(store.require_sweep("ln"), "d1-gaussian-none-s0")
        store.add_checkpoint(tid, 20, str(link), kind="resume")
        # a link inside the sweep's own experiment directory, to a file outside
        (outside / "note.txt").write_text("keep me")
        os.symlink(outside / "note.txt",
                   storage / "qkgeom-ln-arms" / "d1-gaussian-none-s0_00000" / "n.txt")
    r = cli("sweep", "delete", "--name", "ln", "--db", db_url, "--yes")
    assert r.exit_code == 0, r.output
    assert f"  {storage / 'qkgeom-ln'}\n" in r.output and f"  {link}\n" in r.output
    assert not os.path.lexists(storage / "qkgeom-ln") and not os.path.lexists(link)
    assert not (storage / "qkgeom-ln-arms").exists()
    assert tree(outside / "exp") == files["exp"] and tree(outside / "ckpt") == files["ckpt"]
    assert (outside / "note.txt").read_text() == "keep me"


def test_a_merged_copy_does_not_own_its_origins_files(tmp_path):
    """``db merge --from d.db --db m.db``, then ``sweep delete --name keeper --db m.db
    --yes`` (what the merge's name-clash message suggests): the rows go from m.db, the
    files d.db references stay (they are d.db's), and the command says which and why.
    Deleting it in d.db, whose driver stamped them, removes them."""
    from qkgeom.store.lease import database_identity

    d, m = f"sqlite:///{tmp_path / 'd.db'}", f"sqlite:///{tmp_path / 'm.db'}"
    storage = tmp_path / "ray"
    with open_store(d) as store:
        plant_sweep(store, "keeper", storage, ["qkgeom-keeper"])
        stamp_directory(str(storage / "qkgeom-keeper"), database_identity(store), "keeper")
        origin = database_identity(store)
    files = tree(storage)
    r = cli("db", "merge", "--from", d, "--db", m)
    assert r.exit_code == 0, r.output
    r = cli("sweep", "delete", "--name", "keeper", "--db", m, "--yes")
    assert r.exit_code == 0, r.output
    assert f"merged from database {origin}: its rows go, its files stay" in r.output
    assert f"kept: {storage / 'qkgeom-keeper'} (the sweep was merged from database " \
        f"{origin}" in r.output
    assert "removed 0 path(s)" in r.output and "left 1 path(s) in place" in r.output
    assert tree(storage) == files
    with open_store(m, create=False, readonly=True) as store:
        assert store.sweep_names() == []
    r = cli("sweep", "delete", "--name", "keeper", "--db", d, "--yes")
    assert r.exit_code == 0 and "removed 1 path(s)" in r.output, r.output
    assert not (storage / "qkgeom-keeper").exists()


def test_a_directory_stamped_by_another_database_is_kept(sqlite_url, tmp_path):
    storage = tmp_path / "ray"
    with open_store(sqlite_url) as store:
        plant_sweep(store, "s", storage, ["qkgeom-s"])
    (storage / "qkgeom-s" / OWNER_STAMP).write_text(json.dumps({"database": "0" * 32,
                                                               "sweep": "s"}))
    files = tree(storage)
    r = cli("sweep", "delete", "--name", "s", "--db", sqlite_url, "--yes")
    assert r.exit_code == 0, r.output
    assert f"{OWNER_STAMP} says it belongs to sweep 's' of database {'0' * 32}" in r.output
    assert tree(storage) == files


def test_dry_run_changes_no_byte_of_the_database(tmp_path):
    """On main ``--dry-run`` switched a rollback-journal SQLite file to WAL."""
    import sqlite3

    db = tmp_path / "j.db"
    url = f"sqlite:///{db}"
    with open_store(url) as store:
        plant_sweep(store, "x", tmp_path / "ray", ["qkgeom-x"])
    con = sqlite3.connect(db)
    assert con.execute("PRAGMA journal_mode=DELETE").fetchone()[0] == "delete"
    con.close()
    before, mtime = sha(db), db.stat().st_mtime_ns
    r = cli("sweep", "delete", "--name", "x", "--db", url, "--dry-run")
    assert r.exit_code == 0 and "nothing was deleted" in r.output, r.output
    assert sha(db) == before and db.stat().st_mtime_ns == mtime
    assert sorted(p.name for p in tmp_path.iterdir()) == ["j.db", "ray"]  # no -wal, -shm


HOLD = r"""
import sys, time
from qkgeom.store import open_store
from qkgeom.store.lease import LeaseKeeper, acquire
url, name = sys.argv[1], sys.argv[2]
with open_store(url) as store:
    sid = store.require_sweep(name)
    token, _ = acquire(store, sid, name, stale_after_s=3.0, command="test holder")
with LeaseKeeper(url, sid, token, 0.5):
    print("held", flush=True)
    sys.stdin.read()  # until the test closes stdin
"""


def hold_lease(url: str, name: str) -> subprocess.Popen:
    """A real process that takes sweep ``name``'s lease and renews it until its stdin
    closes."""
    p = subprocess.Popen([sys.executable, "-c", HOLD, url, name], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def running_sweep(store, name: str, storage: Path, *, heartbeat_s: float | None,
                  beat_age_s: float) -> None:
    from datetime import datetime, timedelta, timezone

    import sqlalchemy as sa

    plant_sweep(store, name, storage, [f"qkgeom-{name}"])
    sid = store.ensure_sweep(name, store.sweep_spec(name), "v", heartbeat_s=heartbeat_s)
    tid = store.trial_id(sid, "d1-gaussian-none-s0")
    store.set_trial_status(tid, "running", bump_attempts=True)
    with store._write() as conn:
        t = sa.table("trials", sa.column("id"), sa.column("heartbeat_at"))
        conn.execute(t.update().where(t.c.id == tid).values(
            heartbeat_at=datetime.now(timezone.utc) - timedelta(seconds=beat_age_s)))


def test_a_live_lease_refuses_the_delete_even_with_an_old_trial_heartbeat(db_url, tmp_path):
    """A trial heartbeat 200 s old (interval 30 s) but a driver that renews its lease: on
    main the sweep was deleted while running; now refused, --stopped included."""
    storage = tmp_path / "ray"
    with open_store(db_url) as store:
        running_sweep(store, "live", storage, heartbeat_s=30.0, beat_age_s=200)
    files = tree(storage)
    holder = hold_lease(db_url, "live")
    try:
        for extra in ([], ["--stopped"]):
            r = cli("sweep", "delete", "--name", "live", "--db", db_url, "--yes", *extra)
            assert r.exit_code == 1, r.output
            assert "may be running" in r.output and "its driver holds the lease: pid " \
                f"{holder.pid}" in r.output
            assert "--stopped" not in r.output.strip().splitlines()[-1]  # no way around it
        assert tree(storage) == files
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    r = cli("sweep", "delete", "--name", "live", "--db", db_url, "--yes")  # released: gone
    assert r.exit_code == 0 and "their driver is provably gone" in r.output, r.output


def test_a_run_with_no_heartbeat_interval_counts_as_live(db_url, tmp_path):
    """A running trial of a sweep that promises no heartbeat (``qkgeom train --db`` of
    older versions) and has no lease: nothing proves its process gone, so the delete is
    refused; ``--stopped`` (the user knows) deletes it."""
    storage = tmp_path / "ray"
    with open_store(db_url) as store:
        running_sweep(store, "quiet", storage, heartbeat_s=None, beat_age_s=3600)
    files = tree(storage)
    r = cli("sweep", "delete", "--name", "quiet", "--db", db_url, "--yes")
    assert r.exit_code == 1 and "no heartbeat interval recorded" in r.output, r.output
    assert "give --stopped" in r.output and tree(storage) == files
    r = cli("sweep", "delete", "--name", "quiet", "--db", db_url, "--yes", "--stopped")
    assert r.exit_code == 0 and "deleted sweep quiet" in r.output, r.output


def test_a_driver_that_starts_while_the_prompt_waits_is_seen(db_url, tmp_path, scratch):
    """The liveness check runs again inside the deleting transaction, after the prompt:
    a driver that took the sweep's lease meanwhile stops the delete; nothing is removed."""
    from sweep_fixtures import QKGEOM, cli_env

    storage = tmp_path / "ray"
    with open_store(db_url) as store:
        plant_sweep(store, "late", storage, ["qkgeom-late"])
    files = tree(storage)
    p = subprocess.Popen([QKGEOM, "sweep", "delete", "--name", "late", "--db", db_url],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=cli_env(scratch))
    out = ""
    deadline = time.monotonic() + 60
    while "delete sweep late" not in out and time.monotonic() < deadline:
        out += p.stdout.read(1)  # the listing, then the prompt (no newline after it)
    holder = hold_lease(db_url, "late")
    try:
        rest, _ = p.communicate("y\n", timeout=60)
        out += rest
        assert p.returncode == 1, out
        assert "sweep late may be running" in out and "holds the lease" in out, out
        assert tree(storage) == files
        with open_store(db_url, create=False, readonly=True) as store:
            assert store.sweep_names() == ["late"]
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)


def test_stamps_written_by_a_real_train_db_make_its_checkpoints_deletable(
        tmp_path, wikitext_dir, monkeypatch):
    """``qkgeom train --db`` stamps its checkpoint directory and records a heartbeat
    interval: delete removes its checkpoints (named like qkgeom's) and keeps the rest
    of the run directory."""
    from sweep_fixtures import run_cli

    url = f"sqlite:///{tmp_path / 't.db'}"
    out = tmp_path / "run"
    run_cli(["train", "--preset", "smoke", "--data", str(wikitext_dir), "--out", str(out),
             "--db", url, "--name", "tr", "--set", "max_steps=20", "--set", "probe_every=10",
             "--set", "eval_every=10"], tmp_path)
    stamp = json.loads((out / "checkpoints" / OWNER_STAMP).read_text())
    from qkgeom.store.lease import database_identity

    with open_store(url, create=False, readonly=True) as store:
        assert stamp == {"database": database_identity(store), "sweep": "tr"}
        assert store.sweeps()["heartbeat_s"].to_list() == [30.0]
    r = cli("sweep", "delete", "--name", "tr", "--db", url, "--yes")
    assert r.exit_code == 0 and "deleted sweep tr" in r.output, r.output
    assert (out / "probes.jsonl").exists()
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith("step_")]


def test_a_hostile_location_named_like_a_checkpoint_is_kept(db_url, tmp_path):
    """A database may record any path. Unstamped, a location is the sweep's only for a
    sweep recorded before stamps existed (no origin), and only where qkgeom writes saved
    state (``.../checkpoints/step_N``, ``.../snapshots/step_N``, ``<trial dir>/checkpoint_N``);
    a post-stamp sweep's unstamped location is never. The decoys stay byte for byte."""
    import sqlalchemy as sa

    decoy = tmp_path / "important" / "checkpoint_000001"
    decoy.mkdir(parents=True)
    files = decoys(decoy)
    legacy = tmp_path / "old-run" / "checkpoints" / "step_0000010"  # train --db, long ago
    legacy.mkdir(parents=True)
    (legacy / "state.pt").write_bytes(b"old weights")
    with open_store(db_url) as store:
        one_location_sweep(store, "new", str(decoy))
        one_location_sweep(store, "old", str(decoy.parent.parent / "x" / "checkpoint_000001"))
        tid = store.trial_id(store.require_sweep("old"), "d1-gaussian-none-s0")
        store.add_checkpoint(tid, 20, str(decoy), kind="snapshot")
        store.add_checkpoint(tid, 30, str(legacy), kind="resume")
        with store._write() as conn:  # as revision 0009 leaves a sweep recorded before it
            conn.execute(sa.text("UPDATE sweeps SET origin = NULL WHERE name = 'old'"))
    r = cli("sweep", "delete", "--name", "new", "--db", db_url, "--dry-run")
    assert f"kept: {decoy} (" in r.output and "files: 0 path(s)" in r.output, r.output
    with open_store(db_url) as store:  # alone, it is refused for what it is
        with store._write() as conn:
            conn.execute(sa.text("DELETE FROM checkpoints WHERE step = 20"))
    r = cli("sweep", "delete", "--name", "new", "--db", db_url, "--yes")
    assert r.exit_code == 0, r.output
    assert f"kept: {decoy} (not a directory qkgeom made for this sweep" in r.output
    r = cli("sweep", "delete", "--name", "old", "--db", db_url, "--yes")
    assert r.exit_code == 0, r.output
    assert f"  {legacy}\n" in r.output and not legacy.exists()  # the old sweep's own
    assert tree(decoy) == files
