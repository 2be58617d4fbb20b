"""``qkgeom sweep delete``: one sweep's rows and files go, every other sweep's stay byte
for byte; ``--dry-run`` and a refused prompt change nothing.

Two sweeps share one database (SQLite and PostgreSQL) and one Tune storage, written
through the Store API with real files where a sweep puts them; the other is named so
that its main experiment directory matches the first one's arm-experiment pattern
(``qkgeom-x-arms``), and it records its locations as ``file://`` URIs. A real tiny sweep
(Ray, SQLite) checks the same on the files Tune and the trainable write.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers import make_record

from qkgeom.cli import main
from qkgeom.records import StepRecord
from qkgeom.store import open_store
from qkgeom.sweeps.files import STORAGE_KEY, is_experiment_of


def cli(*args: str, input: str | None = None):
    return CliRunner().invoke(main, list(args), input=input, catch_exceptions=False)


def tree(root: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under ``root``."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def rows(url: str, sweep: str | None = None) -> dict[str, list]:
    """Every row of every table (of one sweep's trials when ``sweep`` is given), sorted."""
    from qkgeom.store.models import TRIAL_TABLES

    where = "" if sweep is None else " WHERE s.name = :n"
    p = {} if sweep is None else {"n": sweep}
    out = {}
    with open_store(url, create=False, readonly=True) as store:
        out["sweeps"] = store.sql(f"SELECT s.* FROM sweeps s{where}", p or None).rows()
        out["trials"] = store.sql("SELECT t.* FROM trials t JOIN sweeps s ON s.id = t.sweep_id"
                                  + where, p or None).rows()
        for tab in TRIAL_TABLES:
            out[tab.name] = store.sql(
                f"SELECT x.* FROM {tab.name} x JOIN trials t ON t.id = x.trial_id "
                f"JOIN sweeps s ON s.id = t.sweep_id{where}", p or None).rows()
    return {k: sorted(map(repr, v)) for k, v in out.items()}


def write_state(d: Path, step: int) -> None:
    d.mkdir(parents=True)
    (d / "state.pt").write_bytes(f"weights at {step} of {d}".encode() * 50)


def plant_sweep(store, name: str, storage: Path, experiments: list[str], *,
                uri: bool = False, outside: Path | None = None) -> None:
    """A sweep with one trial per experiment directory: probes, metrics, training steps,
    a resume checkpoint and a snapshot each, on disk where a sweep writes them."""
    from qkgeom.store.lease import database_identity
    from qkgeom.sweeps.files import stamp_directory

    root = f"file://{storage}" if uri else str(storage)
    sid = store.ensure_sweep(name, {"name": name, STORAGE_KEY: root}, "v")
    for exp in experiments:  # stamped as the sweep's driver stamps them
        stamp_directory(str(storage / exp), database_identity(store), name)
    for i, exp in enumerate(experiments):
        key = f"d1-gaussian-none-s{i}"
        tid = store.ensure_trial(sid, key, {"max_steps": 20}, depth=1, init="gaussian",
                                 arm="none", seed=i, status="terminated")
        store.write_probes(tid, [make_record(s, n_layer=1, n_head=2, max_steps=20, history=2)
                                 for s in (0, 10, 20)])
        store.write_steps(tid, [StepRecord(step=21, train_loss=2.0, val_loss=2.1, lr=1e-3,
                                           tokens_per_s=10.0)])
        trial_dir = storage / exp / f"{key}_{i:05d}"
        for kind, d in (("resume", trial_dir / "checkpoint_000001"),
                        ("snapshot", trial_dir / "snapshots" / "step_0000010")):
            write_state(d, 10)
            store.add_checkpoint(tid, 10, f"file://{d}" if uri else str(d), kind=kind)
        (trial_dir / "result.json").write_text("{}")
    if outside is not None:  # a location outside the storage (qkgeom train --db's run dir,
        d = outside / name / "checkpoints" / "step_20"  # stamped as train --db stamps it)
        write_state(d, 20)
        stamp_directory(str(d.parent), database_identity(store), name)
        store.add_checkpoint(tid, 20, str(d), kind="resume")


@pytest.fixture
def two_sweeps(db_url, tmp_path):
    tmp_path = tmp_path / "files"  # not the SQLite file's directory: only sweep files here
    storage, outside = tmp_path / "ray", tmp_path / "runs"
    with open_store(db_url) as store:
        plant_sweep(store, "x", storage, ["qkgeom-x", "qkgeom-x-arms-2"], outside=outside)
        plant_sweep(store, "x-arms", storage, ["qkgeom-x-arms"], uri=True)
    (storage / "qkgeom-xy").mkdir()  # no sweep's: another database's, say
    (storage / "qkgeom-xy" / "keep.txt").write_text("not x's")
    (storage / "notes.txt").write_text("mine")
    (outside / "x" / "probes.jsonl").write_text("{}\n")  # beside x's checkpoints: not theirs
    return db_url, tmp_path


def test_every_table_of_trial_rows_is_deleted_with_its_sweep():
    from qkgeom.store.models import TRIAL_TABLES, Base

    assert set(TRIAL_TABLES) == {t for t in Base.metadata.sorted_tables if "trial_id" in t.c}


def test_experiment_names():
    assert is_experiment_of("qkgeom-x", "x") and is_experiment_of("qkgeom-x-arms", "x")
    assert is_experiment_of("qkgeom-x-arms-2", "x") and is_experiment_of("qkgeom-x-arms-17", "x")
    for other in ("qkgeom-xy", "qkgeom-x-arms-1", "qkgeom-x-arms-02", "qkgeom-x-armsy",
                  "qkgeom-x-2", "x", "qkgeom-X"):
        assert not is_experiment_of(other, "x"), other
    assert is_experiment_of("qkgeom-a.b+c", "a.b+c") and not is_experiment_of("qkgeom-aXb", "a.b")


def test_dry_run_and_a_refused_prompt_change_nothing(two_sweeps):
    url, tmp = two_sweeps
    files, before = tree(tmp), rows(url)
    r = cli("sweep", "delete", "--name", "x", "--db", url, "--dry-run")
    assert r.exit_code == 0, r.output
    out = r.output
    assert "sweep x in " in out and "2 trials, 0 attempts, 6 probes" in out and "5 checkpoint rows" in out
    assert f"  {tmp / 'ray' / 'qkgeom-x'}\n" in out
    assert f"  {tmp / 'ray' / 'qkgeom-x-arms-2'}\n" in out
    assert f"  {tmp / 'runs' / 'x' / 'checkpoints' / 'step_20'}\n" in out
    assert "files: 3 path(s)" in out
    assert f"kept: {tmp / 'ray' / 'qkgeom-x-arms'} (also an experiment directory of sweep " \
        "x-arms)" in out
    assert "nothing was deleted" in out
    r = cli("sweep", "delete", "--name", "x", "--db", url, input="n\n")
    assert r.exit_code == 1 and "Aborted" in r.output
    assert tree(tmp) == files and rows(url) == before


def test_delete_removes_one_sweep_and_nothing_of_the_other(two_sweeps):
    url, tmp = two_sweeps
    files = tree(tmp)
    other = rows(url, "x-arms")
    mine = rows(url, "x")
    r = cli("sweep", "delete", "--name", "x", "--db", url, input="y\n")
    assert r.exit_code == 0, r.output
    n_metrics, n_steps = len(mine["probe_metrics"]), len(mine["train_steps"])
    assert n_metrics > 100 and n_steps == 10
    assert (f"deleted sweep x: 2 trials, 0 attempts, 6 probes, {n_metrics:,} metric values, "
            f"{n_steps} training steps, 5 checkpoint rows; removed 3 path(s)") in r.output
    # the other sweep's rows, byte for byte, and nothing else is left
    assert rows(url) == other
    gone = ("ray/qkgeom-x/", "ray/qkgeom-x-arms-2/", "runs/x/checkpoints/step_20/")
    assert tree(tmp) == {k: v for k, v in files.items() if not k.startswith(gone)}
    assert not (tmp / "ray" / "qkgeom-x").exists()
    assert (tmp / "runs" / "x" / "probes.jsonl").exists()
    # the missing sweep is one line that names the sweeps there
    r = cli("sweep", "delete", "--name", "x", "--db", url, "--yes")
    out = r.output.strip()
    assert r.exit_code == 1 and "\n" not in out and out.startswith("Error: no sweep named 'x'")
    assert out.endswith("sweeps: x-arms")
    # the other one, whose locations are file:// URIs, goes as well when asked
    r = cli("sweep", "delete", "--name", "x-arms", "--db", url, "--yes")
    assert r.exit_code == 0, r.output
    assert f"file://{tmp / 'ray'}/qkgeom-x-arms" in r.output
    assert not (tmp / "ray" / "qkgeom-x-arms").exists()
    assert sorted(tree(tmp)) == ["ray/notes.txt", "ray/qkgeom-xy/keep.txt",
                                 "runs/x/checkpoints/.qkgeom-owner.json",  # the run's stamp
                                 "runs/x/probes.jsonl"]
    assert all(v == [] for v in rows(url).values())


def test_a_location_another_sweep_shares_is_kept(db_url, tmp_path):
    """A sweep whose checkpoint lies in the first one's trial directory keeps that
    directory alive (the first sweep's rows still go)."""
    tmp_path = tmp_path / "files"
    with open_store(db_url) as store:
        plant_sweep(store, "a", tmp_path / "ray", ["qkgeom-a"])
        sid = store.ensure_sweep("b", {"name": "b"}, "v")  # no storage recorded
        tid = store.ensure_trial(sid, "k", {}, depth=1, init="gaussian", arm="none", seed=0)
        shared = tmp_path / "ray" / "qkgeom-a" / "d1-gaussian-none-s0_00000" / "checkpoint_000001"
        store.add_checkpoint(tid, 1, str(shared))
    files = tree(tmp_path)
    r = cli("sweep", "delete", "--name", "a", "--db", db_url, "--yes")
    assert r.exit_code == 0, r.output
    trial = tmp_path / "ray" / "qkgeom-a" / "d1-gaussian-none-s0_00000"
    assert f"kept: {trial.parent} (holds or lies in a checkpoint of sweep b)" in r.output
    assert f"kept: {shared} (holds or lies in a checkpoint of sweep b)" in r.output
    # a's own snapshot in that directory goes; b's checkpoint and the rest stay
    assert f"  {trial / 'snapshots' / 'step_0000010'}\n" in r.output
    snap = "ray/qkgeom-a/d1-gaussian-none-s0_00000/snapshots/step_0000010/state.pt"
    assert tree(tmp_path) == {k: v for k, v in files.items() if k != snap}
    with open_store(db_url, create=False, readonly=True) as store:
        assert store.sweeps()["name"].to_list() == ["b"]
        assert store.trial_checkpoints("b", "k") == [(1, "resume", str(shared))]
    r = cli("sweep", "delete", "--name", "b", "--db", db_url, "--dry-run")
    # b recorded a location in a's experiment directory, which a's driver stamped: not b's
    assert "no Ray storage is recorded" in r.output
    assert f"kept: {shared} ({tmp_path / 'ray' / 'qkgeom-a'}/.qkgeom-owner.json says it " \
        "belongs to sweep 'a'" in r.output


def test_run_options_before_delete_are_refused(tmp_path):
    r = cli("sweep", "--preset", "smoke", "delete", "--name", "x", "--db", str(tmp_path / "d.db"))
    assert r.exit_code == 2 and "--preset before 'delete' belong to a sweep run" in r.output
    r = cli("sweep", "delete", "--name", "x", "--db", str(tmp_path / "d.db"))
    assert r.exit_code == 1 and "no database at" in r.output
    assert not (tmp_path / "d.db").exists()


@pytest.mark.ray
@pytest.mark.slow
def test_delete_after_two_real_sweeps(tmp_path, wikitext_dir):
    """Two real tiny sweeps (a baseline and a baseline-relative arm each: two Tune
    experiments, resume checkpoints and snapshots) in one database and one storage."""
    from sweep_fixtures import run_cli

    scratch = tmp_path / "s"
    scratch.mkdir()
    db = str(tmp_path / "two.db")
    tiny = ["--data", str(wikitext_dir), "--db", db, "--progress-every", "60"]
    for s in ("max_steps=20", "grid.depths=[1]", "grid.inits=[gaussian]", "grid.seeds=1",
              "interventions.depth=1", "interventions.seeds=[0]", "interventions.arms=[shrink]"):
        tiny += ["--set", s]
    for name in ("one", "two"):
        run_cli(["sweep", "--preset", "smoke", "--name", name, *tiny], scratch)
    url = f"sqlite:///{db}"
    storage = scratch / "ray_results"  # QKGEOM_RAY_STORAGE of sweep_fixtures.cli_env
    assert sorted(p.name for p in storage.iterdir()) == [
        "qkgeom-one", "qkgeom-one-arms", "qkgeom-two", "qkgeom-two-arms"]
    with open_store(url, create=False, readonly=True) as store:
        kinds = store.sql("SELECT kind, count(*) AS n FROM checkpoints c JOIN trials t ON "
                          "t.id = c.trial_id JOIN sweeps s ON s.id = t.sweep_id WHERE "
                          "s.name = 'one' GROUP BY kind ORDER BY kind").rows()
    assert [k for k, _ in kinds] == ["resume", "snapshot"] and all(n >= 2 for _, n in kinds)
    files, before, other = tree(storage), rows(url), rows(url, "two")
    r = run_cli(["sweep", "delete", "--name", "one", "--db", db, "--dry-run"], scratch)
    assert "files: 2 path(s)" in r.stdout and f"  {storage / 'qkgeom-one-arms'}\n" in r.stdout
    assert tree(storage) == files and rows(url) == before
    r = run_cli(["sweep", "delete", "--name", "one", "--db", db, "--yes"], scratch)
    assert "deleted sweep one: 2 trials" in r.stdout
    assert rows(url) == other
    assert tree(storage) == {k: v for k, v in files.items()
                             if not k.startswith(("qkgeom-one/", "qkgeom-one-arms/"))}
    assert sorted(p.name for p in storage.iterdir()) == ["qkgeom-two", "qkgeom-two-arms"]
    # the other sweep still reads whole: its status and its snapshots
    st = run_cli(["status", "--name", "two", "--db", db, "--json"], scratch)
    assert [t["status"] for t in json.loads(st.stdout)] == ["terminated", "terminated"]
