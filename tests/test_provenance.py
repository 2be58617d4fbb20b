"""Provenance per trial attempt: qkgeom's content hash, the git commit and dirty flag, the
Python/torch/Ray/CUDA versions, host and device, in ``trial_attempts``; written by
``qkgeom train --db`` and by a sweep (a real smoke sweep whose trials are retried once);
a resume that runs other code says so in one line and both versions stay recorded."""

from __future__ import annotations

import json
import platform
import shutil
import socket
import subprocess
from importlib import metadata
from pathlib import Path

import pytest
from click.testing import CliRunner

from qkgeom.cli import main
from qkgeom.store import open_store
from qkgeom.sweeps.provenance import SOURCE_PATHS, git_state, provenance
from qkgeom.sweeps.ship import code_version, source_root

ROOT = Path(__file__).resolve().parents[1]


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                          check=True).stdout


def checkout_state() -> tuple[str, bool]:
    """The commit and dirty flag of this checkout, as git itself reports them."""
    return (git("rev-parse", "HEAD").strip(),
            bool(git("status", "--porcelain", "--", *SOURCE_PATHS).strip()))


def test_provenance_of_this_process():
    got = provenance("cpu", node_id="n1")
    assert source_root() == ROOT
    assert (got["git_commit"], got["git_dirty"]) == checkout_state()
    assert got["code_version"] == code_version()
    assert got["python"] == platform.python_version()
    assert got["torch"] == metadata.version("torch") and got["ray"] == metadata.version("ray")
    assert got["host"] == socket.gethostname() and got["device"] == "cpu"
    import torch

    assert got["cuda"] == torch.version.cuda  # None for the CPU build
    assert got["details"]["node_id"] == "n1" and got["details"]["platform"]


def test_git_state_of_a_checkout_and_of_none(tmp_path):
    assert git_state(None) == (None, None)
    assert git_state(tmp_path) == (None, None)  # not a checkout (an installed wheel)
    repo = tmp_path / "repo"
    (repo / "qkgeom").mkdir(parents=True)
    (repo / "qkgeom" / "a.py").write_text("x = 1\n")
    git("init", "-q", cwd=repo)
    git("-c", "user.email=t@t", "-c", "user.name=t", "add", ".", cwd=repo)
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "one", cwd=repo)
    head = git("rev-parse", "HEAD", cwd=repo).strip()
    assert git_state(repo) == (head, False)
    (repo / "notes.txt").write_text("outside the hashed sources: still clean")
    assert git_state(repo) == (head, False)
    (repo / "qkgeom" / "new.py").write_text("y = 2\n")  # untracked, under qkgeom/
    assert git_state(repo) == (head, True)
    (repo / "qkgeom" / "new.py").unlink()
    (repo / "qkgeom" / "a.py").write_text("x = 2\n")  # a tracked change
    assert git_state(repo) == (head, True)


def test_attempt_rows_on_both_backends(db_url):
    with open_store(db_url) as store:
        sid = store.ensure_sweep("p", {}, "v")
        tid = store.ensure_trial(sid, "k", {}, depth=1, init="gaussian", arm="none", seed=0)
        from qkgeom.store.lifecycle import TrialLifecycle

        life = TrialLifecycle(store)
        assert life.started(tid, {"code_version": "c1", "git_commit": "g", "git_dirty": False}) == 1
        first = store.attempts("p").to_dicts()[0]
        assert first["torch"] is None and first["host"] is None  # until the first result
        life.placed(tid, host="h/n", device="cpu",
                    provenance={"torch": "2.13.0", "host": "h", "device": "cpu",
                                "details": {"node_id": "n"}})
        life.retrying(tid, "RuntimeError: once")
        assert life.started(tid, {"code_version": "c2"}) == 2
        rows = store.attempts("p").to_dicts()
        assert [(r["attempt"], r["code_version"], r["torch"], r["host"]) for r in rows] == \
            [(1, "c1", "2.13.0", "h"), (2, "c2", None, None)]
        assert rows[0]["started_at"] == first["started_at"]  # kept by the update
        assert json.loads(rows[0]["details"]) == {"node_id": "n"}
        from qkgeom.errors import QkgeomError

        with pytest.raises(QkgeomError, match="unknown provenance field.*started_at"):
            store.record_attempt(tid, {"started_at": None})
        assert store.sweep_row_counts("p")["trial_attempts"] == 2
        assert store.delete_sweep("p")["trial_attempts"] == 2


def test_train_db_records_its_attempt(tmp_path, wikitext_dir):
    db = f"sqlite:///{tmp_path / 't.db'}"
    r = CliRunner().invoke(main, ["train", "--quiet", "--data", str(wikitext_dir), "--set",
                                  "max_steps=20", "--db", db, "--out", str(tmp_path / "run")],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    commit, dirty = checkout_state()
    with open_store(db, create=False, readonly=True) as store:
        assert store.sweeps()["code_version"].to_list() == [code_version()]  # not a bare 0.1.0
        (a,) = store.attempts("train").to_dicts()
    assert (a["attempt"], a["code_version"], a["git_commit"], a["git_dirty"]) == \
        (1, code_version(), commit, dirty)
    assert (a["torch"], a["device"], a["host"]) == (metadata.version("torch"), "cpu",
                                                    socket.gethostname())


QUERY = ("SELECT t.trial_key, a.attempt, a.code_version, a.git_commit, a.git_dirty, a.python, "
         "a.torch, a.ray, a.cuda, a.host, a.device FROM trial_attempts a JOIN trials t ON "
         "t.id = a.trial_id ORDER BY t.trial_key, a.attempt")


@pytest.mark.ray
@pytest.mark.slow
def test_a_sweep_records_every_attempt_and_a_resume_with_other_code(tmp_path, wikitext_dir):
    from sweep_fixtures import run_cli

    scratch = tmp_path / "s"
    scratch.mkdir()
    db = str(tmp_path / "prov.db")
    args = ["--data", str(wikitext_dir), "--db", db, "--progress-every", "60"]
    for s in ("fail_at_step=25", "grid.depths=[1]", "grid.inits=[gaussian]", "grid.seeds=1",
              "interventions.depth=1", "interventions.seeds=[0]", "interventions.arms=[hold]"):
        args += ["--set", s]
    run_cli(["sweep", "--preset", "smoke", "--name", "prov", *args], scratch)
    q = run_cli(["query", "--db", db, "--format", "json", QUERY], scratch)
    rows = json.loads(q.stdout)
    commit, dirty = checkout_state()
    keys = ["d1-gaussian-hold-s0", "d1-gaussian-none-s0"]
    # every trial failed once at step 25 and was retried: two attempts each, both recorded
    assert [(r["trial_key"], r["attempt"]) for r in rows] == [(k, n) for k in keys
                                                             for n in (1, 2)]
    for r in rows:
        assert (r["code_version"], r["git_commit"], bool(r["git_dirty"])) == \
            (code_version(), commit, dirty), r
        assert (r["python"], r["torch"], r["ray"]) == (
            platform.python_version(), metadata.version("torch"), metadata.version("ray"))
        assert r["host"] == socket.gethostname() and r["device"] == "cpu" and r["cuda"] is None
    st = json.loads(run_cli(["status", "--name", "prov", "--db", db, "--json"], scratch).stdout)
    assert {(x["trial"], x["provenance"]["attempt"], x["provenance"]["git_commit"])
            for x in st} == {(k, 2, commit) for k in keys}

    # as if an older qkgeom had run the sweep: its code on the sweep and the attempts, one
    # trial unfinished and its Tune experiment gone (the resume reruns it from scratch)
    old = "0.0.9+h00000000deadbeef"
    for sql in (f"UPDATE sweeps SET code_version = '{old}'",
                f"UPDATE trial_attempts SET code_version = '{old}'",
                "UPDATE trials SET status = 'error' WHERE trial_key = 'd1-gaussian-hold-s0'"):
        run_cli(["query", "--write", "--db", db, sql], scratch)
    shutil.rmtree(scratch / "ray_results" / "qkgeom-prov")
    p = run_cli(["sweep", "--resume", "--name", "prov", "--db", db, "--progress-every", "60"],
                scratch)
    said = [ln for ln in p.stdout.splitlines() if "this resume runs" in ln]
    assert said == [f"sweep prov ran with qkgeom {old}; this resume runs {code_version()} "
                    "(each trial attempt records its own in trial_attempts)"]
    rows = json.loads(run_cli(["query", "--db", db, "--format", "json", QUERY],
                              scratch).stdout)
    versions = {(r["trial_key"], r["attempt"]): r["code_version"] for r in rows}
    # the rerun trial failed once more at step 25 (a fresh start): attempts 3 and 4
    assert versions == {("d1-gaussian-hold-s0", 1): old, ("d1-gaussian-hold-s0", 2): old,
                        ("d1-gaussian-hold-s0", 3): code_version(),
                        ("d1-gaussian-hold-s0", 4): code_version(),
                        ("d1-gaussian-none-s0", 1): old, ("d1-gaussian-none-s0", 2): old}
    with open_store(f"sqlite:///{db}", create=False, readonly=True) as store:
        assert store.sweeps()["code_version"].to_list() == [code_version()]
