"""The fault catalogue as tests: SQL tricks against ``qkgeom query`` without ``--write``,
bad inputs, signals to a running sweep, and resume after the Tune experiment is lost.

Each case asserts the database afterwards (row counts, states, the SQLite file's bytes)
on SQLite and PostgreSQL.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
from helpers import invoke, make_record

from qkgeom.store import TABLES, open_store


# ---------------------------------------------------------------------- SQL tricks
@pytest.fixture
def filled(db_url):
    """One sweep, two trials with probes; the store is closed before the test runs."""
    with open_store(db_url) as store:
        sid = store.ensure_sweep("grid", {"seeds": [0, 1]}, "v1")
        for seed in (0, 1):
            tid = store.ensure_trial(sid, f"s{seed}", {"seed": seed}, depth=2,
                                     init="gaussian", arm="none", seed=seed)
            store.write_probes(tid, [make_record(s, n_layer=2, n_head=2, history=2)
                                     for s in (0, 10)])
            store.add_checkpoint(tid, 10, f"/ckpt/{seed}")
            store.set_trial_status(tid, "terminated")
    return db_url


def _counts(url: str) -> dict[str, int]:
    with open_store(url, create=False, readonly=True) as store:
        return {t: int(store.sql(f"SELECT COUNT(*) FROM {t}").item()) for t in TABLES}


def _statuses(url: str) -> list[tuple]:
    with open_store(url, create=False, readonly=True) as store:
        return list(store.sql("SELECT id, status, attempts FROM trials ORDER BY id").iter_rows())


def _files(d: Path) -> dict[str, str]:
    """Every file under ``d`` with its hash (SQLite's -wal/-shm side files by name only:
    a reader of a WAL database may create them, empty)."""
    out = {}
    for p in sorted(d.rglob("*")):
        if p.is_file():
            side = p.name.endswith(("-wal", "-shm"))
            out[str(p.relative_to(d))] = "" if side else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


# (sql, note): every one must be refused with a one-line error naming --write and change
# nothing; {tmp} is the test's directory (files a trick would create land there)
TRICKS = [
    ("DELETE FROM trials", "plain write"),
    ("UPDATE trials SET status = 'error'", "plain write"),
    ("INSERT INTO sweeps (name, spec, code_version, created_at) "
     "VALUES ('x', '{}', 'v', CURRENT_TIMESTAMP)", "plain write"),
    ("DROP TABLE checkpoints", "DDL"),
    ("ALTER TABLE trials ADD COLUMN x INTEGER", "DDL"),
    ("CREATE TABLE x (a INTEGER)", "DDL"),
    ("CREATE TEMP TABLE x AS SELECT 1 AS a", "temp tables are writable in read-only PG"),
    ("TRUNCATE trials", "PG write"),
    ("COMMIT; BEGIN READ WRITE; DELETE FROM trials WHERE id = (SELECT MAX(id) FROM trials); "
     "COMMIT", "issue 12 row 1"),
    ("SELECT set_config('default_transaction_read_only', 'off', false); COMMIT; "
     "DELETE FROM trials WHERE id = (SELECT MAX(id) FROM trials)", "issue 12 row 2"),
    ("SELECT 1; DELETE FROM trials", "two statements"),
    ("SELECT 1 -- comment\n; DELETE FROM trials", "two statements behind a comment"),
    ("COMMIT", "transaction control"),
    ("/* hi */ COMMIT", "transaction control behind a comment"),
    ("ROLLBACK", "transaction control"),
    ("BEGIN READ WRITE", "transaction control"),
    ("BEGIN", "transaction control"),
    ("SAVEPOINT a", "transaction control"),
    ("RELEASE a", "transaction control"),
    ("SET TRANSACTION READ WRITE", "transaction mode"),
    ("SET default_transaction_read_only = off", "session setting"),
    ("SET ROLE postgres", "role switch"),
    ("RESET ALL", "session reset"),
    ("SELECT set_config('default_transaction_read_only', 'off', false)", "session setting"),
    ("SELECT set_config('transaction_read_only', 'off', true)", "transaction mode"),
    ("SELECT pg_catalog.\"set_config\"('role', 'none', false)", "quoted function name"),
    ("DO $$BEGIN DELETE FROM trials; END$$", "anonymous code block"),
    ("CALL nosuch()", "procedure"),
    ("COPY trials TO PROGRAM 'touch {tmp}/pwned'", "COPY to a program"),
    ("COPY (SELECT 1) TO '{tmp}/copy.csv'", "COPY to a server file"),
    ("COPY trials FROM '/etc/hostname'", "COPY into a table"),
    ("WITH d AS (DELETE FROM trials RETURNING id) SELECT * FROM d", "writing CTE"),
    ("SELECT * INTO newtable FROM trials", "SELECT INTO creates a table"),
    ("SELECT * FROM trials FOR UPDATE", "row locks"),
    ("EXPLAIN ANALYZE DELETE FROM trials", "EXPLAIN ANALYZE runs its statement"),
    ("SELECT pg_terminate_backend(pg_backend_pid())", "signals another backend"),
    ("SELECT pg_reload_conf()", "server-wide effect"),
    ("SELECT lo_import('/etc/hostname')", "large object from a server file"),
    ("SELECT nextval('trials_id_seq')", "sequence advance"),
    ("SELECT dblink_exec('dbname=postgres', 'DELETE FROM trials')", "another database"),
    ("SELECT query_to_xml('DELETE FROM trials RETURNING 1', true, true, '')", "runs SQL text"),
    ("PREPARE p AS DELETE FROM trials", "prepared write"),
    ("DECLARE c CURSOR WITH HOLD FOR SELECT 1", "cursor outliving the transaction"),
    ("LOAD 'plpgsql'", "loads a library"),
    ("NOTIFY qkgeom", "notification"),
    ("LISTEN qkgeom", "listener"),
    ("VACUUM", "maintenance"),
    ("VACUUM INTO '{tmp}/copy.db'", "SQLite: writes a new file"),
    ("ANALYZE", "maintenance (writes statistics)"),
    ("REINDEX trials", "maintenance"),
    ("ATTACH DATABASE '{tmp}/attached.db' AS e", "SQLite: creates a file"),
    ("DETACH DATABASE main", "SQLite"),
    ("PRAGMA writable_schema = 1", "SQLite: issue 12 row 4"),
    ("PRAGMA journal_mode = DELETE", "SQLite: changes the file"),
    ("PRAGMA query_only = 0", "SQLite"),
    ("PRAGMA user_version = 7", "SQLite: writes the header"),
    ("SELECT load_extension('/nonexistent')", "SQLite: loads code"),
]


SQLITE_ONLY = ("VACUUM INTO", "ATTACH", "DETACH", "PRAGMA", "load_extension")
PG_ONLY = ("TRUNCATE", "SET ", "RESET", "DO ", "CALL", "COPY", "pg_", "lo_", "nextval",
           "dblink", "query_to_xml", "PREPARE", "DECLARE", "LOAD", "NOTIFY", "LISTEN",
           "set_config", "INTO newtable", "EXPLAIN", "FOR UPDATE", "BEGIN READ WRITE", "WITH d AS (DELETE")


def _foreign(sql: str, backend: str) -> bool:
    """A statement of the other backend's dialect: refused as unknown is fine too."""
    if sql.startswith("COMMIT; BEGIN") or "; COMMIT" in sql:
        return False  # the issue's rows: both backends must name --write
    words = SQLITE_ONLY if backend == "postgresql" else PG_ONLY
    return any(w in sql for w in words)


@pytest.mark.parametrize("sql,note", TRICKS, ids=[f"{i:02d}" for i in range(len(TRICKS))])
def test_query_without_write_changes_nothing(filled, tmp_path, sql, note):
    url = filled
    work = tmp_path / "work"
    work.mkdir()
    before = _counts(url), _statuses(url), _files(tmp_path)
    r = invoke("query", "--db", url, sql.replace("{tmp}", str(work)))
    out = r.output.strip()
    assert r.exit_code != 0, f"{note}: ran: {out}"
    assert out.startswith("Error: ") and "\n" not in out and "Traceback" not in out, out
    backend = "sqlite" if url.startswith("sqlite") else "postgresql"
    if _foreign(sql, backend):  # the backend does not know the statement at all
        assert re.search(r"syntax error|no such|does not exist|not authorized|--write", out), out
    else:
        assert "--write" in out, out
    assert "Store.execute" not in out
    assert (_counts(url), _statuses(url), _files(tmp_path)) == before, note
    assert not any(work.iterdir()), f"{note}: created {list(work.iterdir())}"


@pytest.mark.parametrize("sql", [
    "SELECT COUNT(*) AS n FROM trials",
    "  -- a comment first\n  SELECT COUNT(*) AS n FROM trials",
    "/* a comment */ SELECT COUNT(*) AS n FROM trials",
    "WITH x AS (SELECT id FROM trials) SELECT COUNT(*) AS n FROM x",
    "SELECT COUNT(*) AS n FROM v_final WHERE metric LIKE 'pr%'  ;  -- done",
    "SELECT COUNT(*) AS n FROM trials WHERE trial_key <> 'a;b'",
])
def test_reading_statements_still_work(filled, tmp_path, sql):
    before = _files(tmp_path)
    r = invoke("query", "--db", filled, "--format", "csv", sql)
    assert r.exit_code == 0, r.output
    head, value = r.output.split()
    assert head == "n" and int(value) > 0
    assert _files(tmp_path) == before


@pytest.mark.parametrize("sql", ["/* a /* nested */ comment */ SELECT COUNT(*) AS n FROM trials",
                                 "(SELECT COUNT(*) AS n FROM trials)"])
def test_postgres_only_query_forms(pg_url, sql):
    with open_store(pg_url) as store:
        store.ensure_sweep("s", {}, "v")
    r = invoke("query", "--db", pg_url, "--format", "csv", sql)
    assert r.exit_code == 0, r.output
    assert r.output.split() == ["n", "0"]


def test_sqlite_metadata_queries_work(sqlite_url):
    with open_store(sqlite_url):
        pass
    r = invoke("query", "--db", sqlite_url, "--format", "csv",
               "SELECT name FROM pragma_table_info('trials') WHERE name = 'attempts'")
    assert r.exit_code == 0, r.output
    assert r.output.split() == ["name", "attempts"]
    r = invoke("query", "--db", sqlite_url, "PRAGMA table_info(trials)")
    assert r.exit_code == 0, r.output


def test_issue_acceptance_set_config_commit_delete(pg_url):
    """The acceptance line of issue 12, through a real subprocess."""
    import subprocess
    import sys

    with open_store(pg_url) as store:
        sid = store.ensure_sweep("keep", {}, "v")
        store.ensure_trial(sid, "t", {}, depth=2, init="gaussian", arm="none", seed=0)
    before = _counts(pg_url)
    p = subprocess.run(
        [sys.executable, "-c", "from qkgeom.cli import main; main()", "query", "--db", pg_url,
         "SELECT set_config('default_transaction_read_only','off',false); COMMIT; "
         "DELETE FROM trials"], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "--write" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert _counts(pg_url) == before and before["trials"] == 1


# ---------------------------------------------------------------------- refused commands
def _one_line(r) -> str:
    out = r.output.strip()
    assert r.exit_code != 0, out
    assert out.startswith("Error: ") and "\n" not in out and "Traceback" not in out, out
    return out


@pytest.mark.parametrize("cmd", [
    ["sweep", "--resume", "--name", "nosuch", "--db", "{db}"],
    ["status", "--name", "nosuch", "--db", "{db}"],
    ["query", "--db", "{db}", "SELECT 1"],
    ["export", "--db", "{db}", "--out", "{tmp}/dump"],
])
def test_refused_commands_create_nothing(tmp_path, cmd):
    db = tmp_path / "new.db"
    out = _one_line(invoke(*[c.replace("{db}", str(db)).replace("{tmp}", str(tmp_path))
                             for c in cmd]))
    assert "new.db" in out
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args,says", [
    (["--model", "/nonexistent/model"], "--model /nonexistent/model: no such file or directory"),
    (["--model", "./gone"], "--model ./gone: no such file or directory"),
    (["--model", "org/name", "--text", "{tmp}/missing.raw"], "missing.raw: no such file"),
])
def test_a_refused_pretrained_probe_creates_no_database(tmp_path, monkeypatch, args, says):
    """Issue 30, edge 2: the model directory and the text are checked before the results
    database is opened, with or without --db; the message names the missing path."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for db in (["--db", str(tmp_path / "r.db")], []):
        out = _one_line(invoke("probe-pretrained", *db,
                               *[a.replace("{tmp}", str(tmp_path)) for a in args]))
        assert says in out, out
        assert list(tmp_path.iterdir()) == []  # no database file, default or given


def test_a_malformed_cluster_file_is_one_line(tmp_path):
    """Issue 30, edge 5: like a malformed --spec, one line with the file, line and column."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster_name: x\n  bad: [\n")
    out = _one_line(invoke("sweep", "--preset", "smoke", "--cluster", str(bad)))
    assert out == (f"Error: {bad}: cannot parse YAML: line 2, column 6: mapping values are "
                   "not allowed here"), out


def test_resume_of_a_missing_sweep_adds_nothing_to_postgres(pg_url):
    out = _one_line(invoke("sweep", "--resume", "--name", "nosuch", "--db", pg_url))
    assert "no qkgeom schema" in out or "nosuch" in out
    from sqlalchemy import create_engine, inspect

    engine = create_engine(pg_url)
    try:
        assert inspect(engine).get_table_names() == []  # no schema was created
    finally:
        engine.dispose()


# ---------------------------------------------------------------------- bad inputs
ROOT = Path(__file__).resolve().parents[1]


def test_max_concurrent_must_be_positive(tmp_path):
    r = invoke("sweep", "--preset", "smoke", "--max-concurrent", "0", "--db",
               str(tmp_path / "r.db"))
    assert r.exit_code != 0 and "--max-concurrent" in r.output and "x>=1" in r.output
    assert list(tmp_path.iterdir()) == []


def test_invalid_yaml_spec_is_one_line_with_file_and_line(tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text("name: x\ngrid:\n  depths: [2\n  seeds: 1\n")
    out = _one_line(invoke("sweep", "--spec", str(spec), "--db", str(tmp_path / "r.db")))
    assert str(spec) in out and "line 4, column 8" in out
    assert not (tmp_path / "r.db").exists()


def test_invalid_toml_spec_is_one_line(tmp_path):
    spec = tmp_path / "s.toml"
    spec.write_text('name = "x"\n[grid\n')
    out = _one_line(invoke("sweep", "--spec", str(spec), "--db", str(tmp_path / "r.db")))
    assert str(spec) in out and "line 2" in out


def test_toml_specs_need_tomli_before_python_311():
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.replace(" ", "").startswith("tomli") and "python_version<'3.11'"
               in d.replace(" ", "").replace('"', "'") for d in deps), deps


@pytest.mark.parametrize("out", ["{tmp}/missing/x.csv", "{tmp}/afile/x.csv"])
def test_query_unwritable_out_is_one_line(filled, tmp_path, out):
    (tmp_path / "afile").write_text("keep")
    out = out.replace("{tmp}", str(tmp_path))
    msg = _one_line(invoke("query", "--db", filled, "--format", "csv", "--out", out,
                           "SELECT 1 AS a"))
    assert "cannot write" in msg and "--out" in msg
    assert (tmp_path / "afile").read_text() == "keep"


def test_plot_unwritable_out_is_one_line(sqlite_url, tmp_path):
    (tmp_path / "afile").write_text("keep")
    with open_store(sqlite_url) as store:
        sid = store.ensure_sweep("grid", {}, "v1")
        tid = store.ensure_trial(sid, "s0", {}, depth=2, init="gaussian", arm="none", seed=0)
        store.write_probes(tid, [make_record(s, n_layer=2, n_head=2) for s in (0, 10)])
        store.set_trial_status(tid, "terminated")
    for out in (tmp_path / "afile" / "x.png", tmp_path / "nodir" / "x.png"):
        msg = _one_line(invoke("plot", "trajectories", "--db", sqlite_url, "--sweep", "grid",
                               "--out", str(out)))
        assert "does not exist" in msg or "cannot write" in msg
    assert (tmp_path / "afile").read_text() == "keep"


def test_train_refuses_a_non_empty_out(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "probes.jsonl").write_text('{"step": 0}\n')
    out = _one_line(invoke("train", "--preset", "smoke", "--out", str(run), "--quiet"))
    assert "not empty" in out and "--overwrite" in out
    assert (run / "probes.jsonl").read_text() == '{"step": 0}\n'  # untouched


def test_train_overwrite_replaces_the_old_run(wikitext_dir, tmp_path):
    import json

    run = tmp_path / "run"
    (run / "checkpoints" / "step_0009999").mkdir(parents=True)
    (run / "probes.jsonl").write_text('{"step": 999}\n')
    r = invoke("train", "--preset", "smoke", "--data", str(wikitext_dir), "--out", str(run),
               "--set", "max_steps=20", "--set", "probe_every=10", "--overwrite", "--quiet")
    assert r.exit_code == 0, r.output
    steps = [json.loads(x)["step"] for x in (run / "probes.jsonl").read_text().splitlines()]
    assert steps == [0, 10, 20]  # nothing of the old run appended to
    assert not (run / "checkpoints" / "step_0009999").exists()


def test_cpus_per_trial_beyond_the_machine_is_refused_before_anything(tmp_path):
    import os

    n = os.cpu_count() or 1
    out = _one_line(invoke("sweep", "--preset", "smoke", "--cpus-per-trial", str(n + 1),
                           "--db", str(tmp_path / "r.db"), "--storage", str(tmp_path / "rs")))
    assert "--cpus-per-trial" in out and f"{n} CPUs" in out
    assert list(tmp_path.iterdir()) == []


def test_gpus_per_trial_beyond_the_machine_is_refused(tmp_path):
    from qkgeom.sweeps.ray_session import local_gpus

    want = local_gpus() + 1
    out = _one_line(invoke("sweep", "--preset", "smoke", "--gpus-per-trial", str(want),
                           "--db", str(tmp_path / "r.db"), "--storage", str(tmp_path / "rs")))
    assert "--gpus-per-trial" in out
    assert list(tmp_path.iterdir()) == []


def test_cluster_file_resources_no_node_can_hold_are_refused(tmp_path):
    out = _one_line(invoke("sweep", "--preset", "smoke", "--cpus-per-trial", "999",
                           "--cluster", str(ROOT / "cluster" / "aws.yaml")))
    assert "no node type has 999 CPU" in out


def _cluster_variant(tmp_path: Path, old: str, new: str) -> Path:
    text = (ROOT / "cluster" / "local.yaml").read_text()
    assert old in text
    p = tmp_path / "c.yaml"
    p.write_text(text.replace(old, new))
    return p


def test_cluster_provider_type_typo_names_the_fix(tmp_path):
    p = _cluster_variant(tmp_path, "type: local", "type: locall")
    out = _one_line(invoke("sweep", "--preset", "smoke", "--cluster", str(p)))
    assert "provider.type" in out and "did you mean 'local'" in out


def test_cluster_missing_ssh_key_names_the_fix(tmp_path):
    key = tmp_path / "no_such_key"
    p = _cluster_variant(tmp_path, "~/.ssh/qkgeom_ci_ed25519", str(key))
    out = _one_line(invoke("sweep", "--preset", "smoke", "--cluster", str(p)))
    assert "auth.ssh_private_key" in out and "ssh-keygen" in out and str(key) in out


# ---------------------------------------------------------------------- signals, resume
SIG_SPEC = """name: sig
trial: {preset: smoke, overrides: {max_steps: 1500}}
grid: {depths: [1], inits: [gaussian, orthogonal], seeds: [0]}
"""


def _start_sweep(d: Path, wikitext_dir: Path, db: str):
    import subprocess

    from sweep_fixtures import QKGEOM, cli_env

    (d / "spec.yaml").write_text(SIG_SPEC)
    log = open(d / "driver.log", "w")
    # one trial at a time: the first finishes while the second is still running
    proc = subprocess.Popen(
        [QKGEOM, "sweep", "--spec", str(d / "spec.yaml"), "--db", db, "--data",
         str(wikitext_dir), "--storage", str(d / "first"), "--max-concurrent", "1",
         "--progress-every", "60"],
        env=cli_env(d), stdout=log, stderr=subprocess.STDOUT, cwd=d,
        start_new_session=True)
    return proc, log


def _trials(db: str, sweep: str = "sig") -> dict[str, tuple]:
    try:
        with open_store(db, create=False, readonly=True) as store:
            df = store.trials(sweep)
    except Exception:  # not created yet
        return {}
    return {k: (s, a, e) for k, s, a, e in
            zip(df["trial_key"], df["status"], df["attempts"], df["error"])}


def _interrupt(d: Path, wikitext_dir: Path, db: str, sig: int) -> tuple[int, str, list]:
    """Start the 2-trial sweep, send ``sig`` once the first trial finished and the
    second has probed past step 0; returns (exit code, log, the driver's descendants)."""
    import os
    import signal
    import time

    import psutil

    proc, log = _start_sweep(d, wikitext_dir, db)
    kids: list = []
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            st = _trials(db)
            if [s for s, _, _ in st.values()].count("terminated") == 1 and \
                    _last_steps(db).get("d1-orthogonal-none-s0", 0) >= 40:
                break
            assert proc.poll() is None, (d / "driver.log").read_text()
            time.sleep(0.3)
        else:
            pytest.fail("no progress:\n" + (d / "driver.log").read_text())
        kids = psutil.Process(proc.pid).children(recursive=True)
        assert kids  # Ray's processes
        os.kill(proc.pid, sig)
        rc = proc.wait(timeout=120)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        log.close()
    return rc, (d / "driver.log").read_text(), kids


def _last_steps(db: str) -> dict[str, int]:
    try:
        with open_store(db, create=False, readonly=True) as store:
            df = store.sql("SELECT t.trial_key, MAX(p.step) AS s FROM probes p JOIN trials t "
                           "ON t.id = p.trial_id GROUP BY t.trial_key")
    except Exception:
        return {}
    return {k: int(s) for k, s in df.iter_rows()}


def _assert_interrupted_record(db: str, out: str, signame: str) -> None:
    st = _trials(db)
    assert sorted(s for s, _, _ in st.values()) == ["interrupted", "terminated"], st
    status, attempts, error = st["d1-orthogonal-none-s0"]
    step = _last_steps(db)["d1-orthogonal-none-s0"]
    assert status == "interrupted" and 0 < step < 1500
    assert error == f"interrupted by {signame} at step {step} of 1500 (its last probe)"
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"sweep sig interrupted by {signame}: 1/2 trials terminated, "
                           "1 interrupted, 0 not started; continue with: qkgeom sweep "
                           "--resume --name sig"), last
    assert "2/2 done" not in out
    # the progress total is the plan's from the first line on
    totals = {line.split(" done")[0].split("/")[-1] for line in out.splitlines()
              if " done, " in line}
    assert totals == {"2"}, totals


def _assert_no_helpers_left(kids: list) -> None:
    alive = [p for p in kids if p.is_running() and p.status() != "zombie"]
    assert not alive, [(p.pid, p.name()) for p in alive]


def test_sigterm_marks_running_trials_interrupted_and_leaves_no_ray(scratch, db_url,  # noqa: F811
                                                                     wikitext_dir):
    """On both backends (``db_url`` is parametrised over SQLite and PostgreSQL)."""
    import signal

    from sweep_fixtures import assert_matches_reference, run_cli

    db = db_url
    rc, out, kids = _interrupt(scratch, wikitext_dir, db, signal.SIGTERM)
    assert rc == 128 + signal.SIGTERM, out
    _assert_interrupted_record(db, out, "SIGTERM")
    _assert_no_helpers_left(kids)
    before = _trials(db)
    # a resume without --storage (none in the environment either) uses the one recorded
    # with the sweep: the experiment is restored, the finished trial is not retrained
    p = run_cli(["sweep", "--resume", "--name", "sig", "--db", db, "--progress-every", "60"],
                scratch, env={"QKGEOM_RAY_STORAGE": ""})
    assert f"Ray storage {scratch / 'first'}" in p.stdout, p.stdout
    after = _trials(db)
    assert after["d1-gaussian-none-s0"] == before["d1-gaussian-none-s0"]
    assert after["d1-orthogonal-none-s0"][:2] == ("terminated", 2)
    assert assert_matches_reference(db, "sig") == 2


def test_sigint_then_resume_with_another_storage_retrains_no_finished_trial(
        scratch, db_url, wikitext_dir):  # noqa: F811
    """On both backends (``db_url`` is parametrised over SQLite and PostgreSQL)."""
    import shutil
    import signal

    from sweep_fixtures import assert_matches_reference, run_cli

    db = db_url
    rc, out, kids = _interrupt(scratch, wikitext_dir, db, signal.SIGINT)
    assert rc == 128 + signal.SIGINT, out
    _assert_interrupted_record(db, out, "SIGINT")
    _assert_no_helpers_left(kids)
    before = _trials(db)

    # the experiment is still at the first run's storage: a resume elsewhere is refused
    p = run_cli(["sweep", "--resume", "--name", "sig", "--db", db, "--storage",
                 str(scratch / "other")], scratch, check=False)
    assert p.returncode != 0
    err = p.stderr.strip()
    assert "\n" not in err and f"--storage {scratch / 'first'}" in err, err
    assert _trials(db) == before and not (scratch / "other").exists()

    # the experiment is lost: the resume runs only the unfinished trial, afresh
    shutil.rmtree(scratch / "first")
    p = run_cli(["sweep", "--resume", "--name", "sig", "--db", db, "--storage",
                 str(scratch / "other"), "--progress-every", "60"], scratch)
    assert "running the 1 unfinished trial(s) of 2 afresh" in p.stdout
    after = _trials(db)
    assert after["d1-gaussian-none-s0"] == before["d1-gaussian-none-s0"]  # attempts 1
    assert after["d1-orthogonal-none-s0"][:2] == ("terminated", 2)
    assert assert_matches_reference(db, "sig") == 2


def test_a_database_error_in_the_driver_is_one_line_with_the_resume(scratch,  # noqa: F811
                                                                    wikitext_dir):
    """A qkgeom error inside a driver callback (here: the next trial's row was deleted under
    the running sweep) ends the run with one line that names it and the resume command,
    not Tune's traceback, and the running trial is recorded as interrupted."""
    import sqlite3
    import time

    db_file = scratch / "cb.db"
    db = f"sqlite:///{db_file}"
    proc, log = _start_sweep(scratch, wikitext_dir, db)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            if [s for s, _, _ in _trials(db).values()].count("running") == 1:
                break
            time.sleep(0.2)
        with sqlite3.connect(db_file, timeout=30) as con:  # the second trial's row
            con.execute("DELETE FROM trials WHERE trial_key = 'd1-orthogonal-none-s0'")
        rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    out = (scratch / "driver.log").read_text()
    assert rc == 1, out
    assert "Traceback" not in out, out
    last = out.strip().splitlines()[-1]
    assert last == ("Error: sweep sig stopped: trial d1-orthogonal-none-s0 of sweep sig is "
                    "not in the database; the trials that were running are marked "
                    "interrupted; once the cause is fixed, continue with: qkgeom sweep "
                    "--resume --name sig"), out
    st = _trials(db)
    assert list(st) == ["d1-gaussian-none-s0"] and st["d1-gaussian-none-s0"][0] == "terminated"


# ---------------------------------------------------------------------- arm pairing
PAIR_SPEC = """name: pair
trial: {preset: smoke, overrides: {max_steps: 1000, probe_every: 100, eval_every: 100}}
interventions:
  depth: 1
  init: gaussian
  arms: [hold, shrink]
  seeds: [0]
  arm_overrides: {shrink: {target_mode: baseline_fraction, shrink_to: 0.5}}
"""
BASE, HOLD, SHRINK = "d1-gaussian-none-s0", "d1-gaussian-hold-s0", "d1-gaussian-shrink-s0"


def _busy_trainable(driver_pid: int):
    """The Ray worker process that runs a trial now (its title names Tune's trainable)."""
    import psutil

    for p in psutil.Process(driver_pid).children(recursive=True):
        try:
            title = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if title.startswith("ray::ImplicitFunc") and "IDLE" not in title:
            return p
    return None


def test_an_arm_waits_for_a_failed_baseline_and_a_resume_completes_the_pair(
        scratch, db_url, wikitext_dir):  # noqa: F811
    """Issue 29 on both backends: the baseline's worker is killed (no retries) after its
    step-100 probe. Its baseline-relative arm must not run against the partial trajectory:
    it stays pending with the reason, the arm that needs no baseline runs. ``--resume``
    finishes the baseline and then the arm, and every stored value equals an uninterrupted
    run's. Then (SQLite) the stale case: the baseline's stored trajectory changes after its
    arm ran; the report refuses the pair, and the next resume reruns the arm against it."""
    import json
    import signal
    import subprocess
    import time

    from sweep_fixtures import QKGEOM, assert_matches_reference, cli_env, run_cli

    from qkgeom.analysis import AnalysisError
    from qkgeom.analysis.intervention import paired_trials
    from qkgeom.plan import pairing

    db = db_url
    (scratch / "spec.yaml").write_text(PAIR_SPEC)
    log = open(scratch / "driver.log", "w")
    proc = subprocess.Popen(
        [QKGEOM, "sweep", "--spec", str(scratch / "spec.yaml"), "--db", db, "--data",
         str(wikitext_dir), "--max-concurrent", "1", "--max-failures", "0",
         "--progress-every", "60"],
        env=cli_env(scratch), stdout=log, stderr=subprocess.STDOUT, cwd=scratch,
        start_new_session=True)
    killed = None
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and proc.poll() is None:
            if killed is None and 100 <= _last_steps(db).get(BASE, 0) < 1000:
                worker = _busy_trainable(proc.pid)
                if worker is not None:
                    worker.send_signal(signal.SIGKILL)
                    killed = _last_steps(db).get(BASE)
            time.sleep(0.1)
        rc = proc.wait(timeout=400)
    finally:
        if proc.poll() is None:
            import os

            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    out = (scratch / "driver.log").read_text()
    assert killed is not None and rc == 1, out
    st = _trials(db, "pair")
    assert st[BASE][0] == "error" and st[HOLD][0] == "terminated", st
    assert st[SHRINK][:2] == ("pending", 0), st  # never started against a partial baseline
    assert st[SHRINK][2] == f"waiting for baseline {BASE} (error)", st
    assert f"arm {SHRINK}: waiting for baseline {BASE} (error)" in out
    last = out.strip().splitlines()[-1]
    assert "1 of them arm(s) waiting for a baseline" in last and \
        "qkgeom sweep --resume --name pair" in last, last
    status = run_cli(["status", "--name", "pair", "--db", db], scratch).stdout
    assert f"waiting for baseline {BASE} (error)" in status, status

    p = run_cli(["sweep", "--resume", "--name", "pair", "--db", db, "--progress-every", "60"],
                scratch)
    st = _trials(db, "pair")
    assert {k: v[0] for k, v in st.items()} == {BASE: "terminated", HOLD: "terminated",
                                                SHRINK: "terminated"}, (st, p.stdout)
    assert st[HOLD][1] == 1 and st[SHRINK][1] == 1  # neither ran twice
    try:
        assert assert_matches_reference(db, "pair") == 3  # every value: an uninterrupted run's
    except AssertionError as e:
        with open_store(db) as store:
            ck = store.sql("SELECT t.trial_key, c.step, c.kind FROM checkpoints c JOIN trials t "
                           "ON t.id = c.trial_id ORDER BY 1, 2").rows()
        raise AssertionError(f"{e}\nkilled at step {killed}; checkpoints {ck}\n--- first run\n"
                             f"{out}\n--- resume\n{p.stdout}\n{p.stderr}") from None
    with open_store(db) as store:
        assert pairing.inconsistent_pairs(store, "pair") == []
        trials = store.trials("pair")
        row = trials.filter(trials["trial_key"] == SHRINK).row(0, named=True)
        ref = json.loads(row["baseline_ref"])
        cfg = json.loads(row["config"])
        assert ref["trial"] == BASE and ref["attempt"] == 2 and ref["metric"] == "pr_wk"
        assert ref["digest"] == pairing.target_digest(cfg["baseline_pr"])
        assert ref["experiment"] == "qkgeom-pair-arms"  # the first run created none
        assert cfg["baseline_pr"][-1][0] == 1000  # from the finished baseline
        pair = dict(arm="shrink", baseline="none", finished_only=True)
        assert paired_trials(store, "pair", **pair).arm.height == 1  # pairs

    if db.startswith("postgresql"):
        return  # the stale case below runs on SQLite (the same code paths; CI time)
    # stale: the baseline's stored trajectory is no longer the one the arm followed
    import sqlalchemy as sa

    with open_store(db) as store:
        bid = store.trial_id(store.require_sweep("pair"), BASE)

    eng = sa.create_engine(db)
    with eng.begin() as conn:
        n = conn.execute(sa.text("UPDATE probe_metrics SET value = value * 1.5 WHERE "
                                 "trial_id = :t AND metric = 'pr_wk' AND head IS NULL"),
                         {"t": bid}).rowcount
    eng.dispose()
    assert n > 0
    with open_store(db) as store:
        with pytest.raises(AnalysisError, match=r"cannot be paired: .*another trajectory .*"
                           r"qkgeom sweep --resume --name pair"):
            paired_trials(store, "pair", **pair)
    r = run_cli(["report", "--sweep", "pair", "--db", db, "--out", str(scratch / "rep")],
                scratch, check=False)
    assert "cannot be paired" in (scratch / "rep" / "report.md").read_text() or \
        "cannot be paired" in r.stdout + r.stderr, (r.stdout, r.stderr)
    p = run_cli(["sweep", "--resume", "--name", "pair", "--db", db, "--progress-every", "60"],
                scratch)
    assert f"arm {SHRINK}: stale: trained against another trajectory of baseline {BASE}" \
        in p.stdout, p.stdout
    st2 = _trials(db, "pair")
    assert st2[SHRINK][:2] == ("terminated", 1) and st2[HOLD] == st[HOLD], st2
    with open_store(db) as store:
        assert pairing.inconsistent_pairs(store, "pair") == []
        row = store.trials("pair").filter(pl_col_eq("trial_key", SHRINK)).row(0, named=True)
        assert json.loads(row["baseline_ref"])["experiment"] == "qkgeom-pair-arms-2"
    assert assert_matches_reference(db, "pair", keys=[SHRINK, HOLD]) == 2


def pl_col_eq(col: str, value: str):
    import polars as pl

    return pl.col(col) == value


def test_a_second_ctrl_c_still_ends_with_the_summary_and_130(scratch, wikitext_dir):  # noqa: F811
    """Issue 30, edge 4: two SIGINTs a moment apart stop the sweep like one (exit 130, the
    summary line with the resume command), not click's 'Aborted!' and exit 1."""
    import os
    import signal
    import time

    db = f"sqlite:///{scratch / 'two.db'}"
    proc, log = _start_sweep(scratch, wikitext_dir, db)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            if _last_steps(db).get("d1-gaussian-none-s0", 0) >= 40:
                break
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGINT)
        time.sleep(0.3)
        os.kill(proc.pid, signal.SIGINT)
        rc = proc.wait(timeout=180)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        log.close()
    out = (scratch / "driver.log").read_text()
    assert rc == 130 and "Aborted!" not in out, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("sweep sig interrupted by SIGINT: ") and \
        "continue with: qkgeom sweep --resume --name sig" in last, last
    assert "running" not in {s for s, _, _ in _trials(db).values()}


def test_a_sigterm_during_start_up_says_how_to_continue(scratch, wikitext_dir):  # noqa: F811
    """Issue 30, edge 6: SIGTERM while the sweep is still starting (the database exists,
    Ray is starting) ends with exit 143 and the line that says how to continue."""
    import os
    import signal
    import time

    db_file = scratch / "early.db"
    proc, log = _start_sweep(scratch, wikitext_dir, f"sqlite:///{db_file}")
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(_trials(f"sqlite:///{db_file}")) < 2:
            time.sleep(0.02)  # recorded, Ray not yet started
        assert db_file.exists(), (scratch / "driver.log").read_text()
        os.kill(proc.pid, signal.SIGTERM)
        rc = proc.wait(timeout=180)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        log.close()
    out = (scratch / "driver.log").read_text()
    assert rc == 128 + signal.SIGTERM, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("sweep sig interrupted by SIGTERM: 0/2 trials terminated") and \
        "continue with: qkgeom sweep --resume --name sig" in last, last


def test_a_sigterm_whose_exception_ray_start_loses_still_stops_the_sweep() -> None:
    """The race behind a CI failure of the test above: the SIGTERM came while ray.init's
    own handler was installed and its SystemExit was raised inside an at-fork hook, which
    printed "Exception ignored" and went on; the sweep then ran to the end. Here Ray's
    handler is one that loses the signal outright: the driver must still see it."""
    import os
    import signal

    import ray._private.utils as ray_utils

    from qkgeom.sweeps.callbacks import signals_seen_during_ray_start, stop_if_signalled
    from qkgeom.sweeps.state import DRIVER_STATE

    before = signal.getsignal(signal.SIGTERM)
    setter = ray_utils.set_sigterm_handler
    DRIVER_STATE.reset()
    try:
        with signals_seen_during_ray_start():
            ray_utils.set_sigterm_handler(lambda signum, frame: None)  # swallowed
            os.kill(os.getpid(), signal.SIGTERM)
        assert ray_utils.set_sigterm_handler is setter  # Ray's own function is back
        assert DRIVER_STATE.interrupted == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):
            stop_if_signalled()
        DRIVER_STATE.reset()
        stop_if_signalled()  # no signal: nothing raised
    finally:
        signal.signal(signal.SIGTERM, before)
        DRIVER_STATE.reset()


def test_a_full_disk_ends_in_one_line_and_a_resume_completes(scratch, wikitext_dir):  # noqa: F811
    """Issue 30, edge 1: the database's file system fills up mid-sweep (a 400 kB tmpfs).
    One line names the cause and the resume, with no traceback; once there is room, the
    resume completes and every stored value equals an uninterrupted run's."""
    import subprocess

    from sweep_fixtures import QKGEOM, assert_matches_reference, cli_env, run_cli

    mnt = scratch / "tiny"
    mnt.mkdir()
    m = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if m.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({m.stderr.strip()})")
    try:
        db = f"sqlite:///{mnt / 'x.db'}"
        p = subprocess.run([QKGEOM, "sweep", "--preset", "smoke", "--name", "full", "--db", db,
                            "--data", str(wikitext_dir), "--storage", str(scratch / "rr"),
                            "--progress-every", "60"], env=cli_env(scratch),
                           capture_output=True, text=True, timeout=600, cwd=scratch)
        out = p.stdout + p.stderr
        assert p.returncode == 1 and "Traceback" not in out, out
        last = out.strip().splitlines()[-1]
        assert last.startswith("Error: sweep full stopped: database error on ") and \
            "database or disk is full" in last and \
            "continue with: qkgeom sweep --resume --name full" in last, last
        subprocess.run(["mount", "-o", "remount,size=64m", str(mnt)], check=True)
        run_cli(["sweep", "--resume", "--name", "full", "--db", db, "--storage",
                 str(scratch / "rr"), "--progress-every", "60"], scratch)
        st = _trials(db, "full")
        assert st and {s for s, _, _ in st.values()} == {"terminated"}, st
        assert assert_matches_reference(db, "full") == len(st)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_ray_helpers_left_by_a_killed_driver_are_stopped_by_the_next_sweep(
        scratch, wikitext_dir):  # noqa: F811
    """Issue 30, edge 3: a driver SIGKILL leaves its local Ray's temp dir (and, on some
    runs, helpers such as the dashboard agent); the next `qkgeom sweep` (here the resume)
    stops whatever still uses it and removes the dir. A live driver's instance is left
    alone (the resume's own sweep runs while it cleans up)."""
    import os
    import signal
    import time

    import psutil
    from sweep_fixtures import run_cli

    db = f"sqlite:///{scratch / 'orphan.db'}"
    proc, log = _start_sweep(scratch, wikitext_dir, db)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            if _last_steps(db).get("d1-gaussian-none-s0", 0) >= 40:
                break
            time.sleep(0.2)
        kids = psutil.Process(proc.pid).children(recursive=True)
        tmps = {a.split("=", 1)[1].split("/session_")[0] for k in kids
                for a in _cmdline(k) if a.startswith("--temp-dir=/tmp/qkray-")}
        assert len(tmps) == 1, tmps
        (tmp,) = tmps
        os.kill(proc.pid, signal.SIGKILL)  # the driver only, as the OOM killer would
        proc.wait(timeout=60)
        time.sleep(3)
        assert os.path.isdir(tmp)  # left behind (and, on some runs, helpers using it)
    finally:
        log.close()
    p = run_cli(["sweep", "--resume", "--name", "sig", "--db", db, "--storage",
                 str(scratch / "first"), "--progress-every", "60"], scratch)
    assert f"removed {tmp}" in p.stdout, p.stdout
    assert not _using(tmp) and not os.path.exists(tmp)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _cmdline(p) -> list[str]:
    import psutil

    try:
        return p.cmdline()
    except psutil.Error:
        return []


def _using(tmp: str) -> list:
    import psutil

    return [p for p in psutil.process_iter() if any(tmp in a for a in _cmdline(p))
            and p.status() != psutil.STATUS_ZOMBIE]
