"""Sweeps on a real local Ray instance into real SQLite and PostgreSQL databases.

* retries: every trial fails once mid-run (``fail_at_step``) and resumes from its Tune
  checkpoint; the stored metrics equal an uninterrupted direct ``train()``;
* the CLI end to end into PostgreSQL (``--preset smoke``), and worker-direct writes;
* the driver killed with SIGKILL mid-sweep, then ``qkgeom sweep --resume`` completes it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from sweep_fixtures import (
    QKGEOM,
    assert_matches_reference,
    assert_sweep_complete,
    cli_env,
    run_cli,
)

pytestmark = pytest.mark.ray


def observe_db_state(monkeypatch, db: str, sweep: str) -> dict[str, list]:
    """Record, from Tune's own callbacks, what the database says about a trial the moment
    Tune recovers it (a retry is due) or gives up on it. Tune calls the callbacks in order,
    so DbWriter has written its update when this observer (in ProgressReporter's place) reads."""
    import qkgeom.sweeps.experiment as T
    from qkgeom.store import open_store

    seen: dict[str, list] = {"recover": [], "error": []}

    def row(trial) -> tuple:
        with open_store(db, create=False, readonly=True) as store:
            t = store.trials(sweep)
        r = t.filter(t["trial_key"] == trial.config["trial"]["key"]).to_dicts()[0]
        return r["trial_key"], r["status"], r["attempts"], r["error"]

    class Observer(T.ProgressReporter):
        def on_trial_recover(self, iteration, trials, trial, **info):
            seen["recover"].append(row(trial))
            super().on_trial_recover(iteration, trials, trial, **info)

        def on_trial_error(self, iteration, trials, trial, **info):
            seen["error"].append(row(trial))
            super().on_trial_error(iteration, trials, trial, **info)

    monkeypatch.setattr(T, "ProgressReporter", Observer)
    return seen


def test_retry_from_checkpoint_matches_uninterrupted(scratch, wikitext_dir,  # noqa: F811
                                                     monkeypatch):
    from qkgeom.plan.spec import plan_from
    from qkgeom.store import open_store
    from qkgeom.sweeps.driver import SweepOptions, run_sweep, shutdown

    plan = plan_from("smoke", data=str(wikitext_dir), name="retry",
                     sets=["fail_at_step=25", "grid.depths=[2]", "interventions.arms=[hold]",
                           "interventions.seeds=[0]"])
    db = f"sqlite:///{scratch}/retry.db"
    seen = observe_db_state(monkeypatch, db, "retry")
    try:
        summary = run_sweep(plan, SweepOptions(db_url=db, storage=str(scratch / "ray"),
                                               max_failures=1, quiet=True,
                                               ray_temp_dir=str(scratch / "r")))
    finally:
        shutdown()
    assert summary["errors"] == 0, summary
    assert_sweep_complete(db, "retry", plan)
    with open_store(db) as store:
        trials = store.trials("retry")
        ckpts = store.sql("SELECT count(*) AS n FROM checkpoints")["n"][0]
    # each trial: one failed attempt at step 25 (its error text kept), one resumed attempt
    assert trials["attempts"].to_list() == [2] * len(plan.trials)
    assert all("injected test failure" in e for e in trials["error"].to_list())
    assert ckpts > 0
    assert assert_matches_reference(db, "retry") == len(plan.trials)
    # while each trial waited for its retry it was pending, with the failure's text
    assert sorted(k for k, *_ in seen["recover"]) == sorted(t.key for t in plan.trials)
    for _, status, attempts, error in seen["recover"]:
        assert (status, attempts) == ("pending", 1)
        assert "InjectedFailure" in error and "fail_at_step=25" in error
    assert seen["error"] == []


@pytest.mark.slow
def test_trial_out_of_retries_ends_in_error(scratch, wikitext_dir, monkeypatch):  # noqa: F811
    from click.testing import CliRunner

    from qkgeom.cli import main
    from qkgeom.plan.spec import plan_from
    from qkgeom.store import open_store
    from qkgeom.sweeps.driver import SweepOptions, run_sweep, shutdown

    plan = plan_from("smoke", data=str(wikitext_dir), name="noretry",
                     sets=["fail_at_step=5", "grid.depths=[1]", "grid.inits=[gaussian]",
                           "grid.seeds=1", "interventions.depth=1", "interventions.arms=[hold]",
                           "interventions.seeds=[0]"])
    keys = sorted(t.key for t in plan.trials)
    assert keys == ["d1-gaussian-hold-s0", "d1-gaussian-none-s0"]
    db = f"sqlite:///{scratch}/noretry.db"
    seen = observe_db_state(monkeypatch, db, "noretry")
    try:
        summary = run_sweep(plan, SweepOptions(db_url=db, storage=str(scratch / "ray"),
                                               max_failures=0, quiet=True,
                                               ray_temp_dir=str(scratch / "r")))
    finally:
        shutdown()
    assert summary["errors"] == 2 and summary["trials"] == dict.fromkeys(keys, "error")
    # Tune gave up at once (no retries): the database already said error when it did
    assert seen["recover"] == []
    assert sorted(k for k, *_ in seen["error"]) == keys
    assert all(st == "error" and n == 1 for _, st, n, _ in seen["error"])
    with open_store(db, create=False, readonly=True) as store:
        t = store.trials("noretry").sort("trial_key")
        probes = store.sql("SELECT trial_id, step FROM probes ORDER BY trial_id, step")
    assert t["status"].to_list() == ["error", "error"] and t["attempts"].to_list() == [1, 1]
    assert all("InjectedFailure: fail_at_step=5" in e for e in t["error"].to_list())
    assert t["ended_at"].null_count() == 0
    # the step-0 probe came before the failure at step 5 and is kept
    assert sorted(probes["step"].to_list()) == [0, 0]
    r = CliRunner().invoke(main, ["status", "--db", db, "--json"], catch_exceptions=False)
    rows = sorted(json.loads(r.output), key=lambda x: x["trial"])
    assert [(x["trial"], x["status"], x["attempts"], x["step"], x["max_steps"])
            for x in rows] == [(k, "error", 1, 0, 40) for k in keys]
    assert all(x["error"].endswith("injected test failure") for x in rows)


@pytest.mark.postgres
def test_cli_smoke_into_postgres(scratch, pg_database_url, wikitext_dir):  # noqa: F811
    from qkgeom.plan.spec import plan_from

    p = run_cli(["sweep", "--preset", "smoke", "--db", pg_database_url, "--data", str(wikitext_dir),
                 "--progress-every", "30"], scratch)
    assert "11/11 trials terminated" in p.stdout
    assert "done" in p.stdout and "ETA" in p.stdout  # our progress line, not Ray's tables
    assert "Trial status" not in p.stdout + p.stderr
    assert "qkgeom stats" in p.stdout
    plan = plan_from("smoke", data=str(wikitext_dir))
    assert_sweep_complete(pg_database_url, "smoke", plan)
    st = run_cli(["status", "--name", "smoke", "--db", pg_database_url], scratch)
    assert "11 terminated" in st.stdout and "40/40" in st.stdout and "test_loss" in st.stdout
    # the final test loss of every trial is in the database
    q = run_cli(["query", "--db", pg_database_url, "--format", "json",
                 "SELECT trial_key, test_loss FROM trials ORDER BY trial_key"], scratch)
    losses = {r["trial_key"]: r["test_loss"] for r in json.loads(q.stdout)}
    assert len(losses) == 11 and all(1.0 < v < 6.0 for v in losses.values()), losses
    # a second start of the same sweep is refused: it must be resumed
    again = run_cli(["sweep", "--preset", "smoke", "--db", pg_database_url, "--data",
                     str(wikitext_dir)], scratch, check=False)
    assert again.returncode != 0 and "--resume --name smoke" in again.stderr
    # the password never reaches Ray's experiment state
    from sqlalchemy.engine import make_url

    pw = make_url(pg_database_url).password
    for f in (scratch / "ray_results").rglob("*"):
        if f.is_file() and f.stat().st_size < 5_000_000:
            assert pw.encode() not in f.read_bytes(), f


@pytest.mark.postgres
def test_direct_writes_postgres_and_refused_for_sqlite(scratch, pg_database_url, wikitext_dir):  # noqa: F811
    from qkgeom.plan.spec import plan_from
    from qkgeom.sweeps.driver import SweepError, SweepOptions, run_sweep, shutdown

    plan = plan_from("smoke", data=str(wikitext_dir), name="direct",
                     sets=["grid.depths=[1]", "grid.inits=[gaussian]",
                           "interventions.depth=1", "interventions.arms=[shrink]",
                           "interventions.seeds=[0]"])
    with pytest.raises(SweepError, match="PostgreSQL"):
        run_sweep(plan, SweepOptions(db_url=f"sqlite:///{scratch}/x.db", direct_writes=True))
    try:
        summary = run_sweep(plan, SweepOptions(db_url=pg_database_url, storage=str(scratch / "ray"),
                                               direct_writes=True, quiet=True,
                                               ray_temp_dir=str(scratch / "r")))
    finally:
        shutdown()
    assert summary["errors"] == 0
    assert_sweep_complete(pg_database_url, "direct", plan)
    p = run_cli(["sweep", "--preset", "smoke", "--db", f"{scratch}/y.db", "--direct-writes"],
                scratch, check=False)
    assert p.returncode != 0 and "PostgreSQL" in p.stderr


def _db_state(db: str, sweep: str) -> tuple[int, int]:
    from qkgeom.store import open_store

    try:  # read-only: the driver, not this poll, creates the database
        with open_store(db, create=False, readonly=True) as store:
            df = store.sql(
                "SELECT t.status, (SELECT count(*) FROM probes p WHERE p.trial_id = t.id) AS n "
                "FROM trials t JOIN sweeps s ON s.id = t.sweep_id WHERE s.name = :n",
                {"n": sweep})
    except Exception:
        return 0, 0
    done = sum(1 for s, _ in df.iter_rows() if s == "terminated")
    return done, int(df["n"].sum()) if df.height else 0


def test_sigkill_driver_then_resume(scratch, wikitext_dir):  # noqa: F811
    from qkgeom.plan.spec import plan_from
    from qkgeom.store import open_store

    db = f"{scratch}/kill.db"
    args = ["--data", str(wikitext_dir), "--set", "max_steps=120", "--set", "grid.seeds=[0]"]
    cmd = [QKGEOM, "sweep", "--preset", "smoke", "--name", "killed", "--db", db,
           "--progress-every", "60", *args]
    log = open(scratch / "driver.log", "w")
    proc = subprocess.Popen(cmd, env=cli_env(scratch), stdout=log, stderr=subprocess.STDOUT,
                            cwd=scratch, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            done, probes = _db_state(db, "killed")
            if done >= 2 and probes >= 2 * 7 + 3:
                break
            assert proc.poll() is None, (scratch / "driver.log").read_text()
            time.sleep(0.2)
        else:
            pytest.fail("the sweep made no progress:\n" + (scratch / "driver.log").read_text())
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        # the driver's own local Ray processes share its session: end them too
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        log.close()
    with open_store(db) as store:
        before = store.trials("killed")
    assert (before["status"] == "running").any() or (before["status"] == "pending").any()
    assert not (before["status"] == "terminated").all()

    p = run_cli(["sweep", "--resume", "--name", "killed", "--db", db,
                 "--progress-every", "60"], scratch)
    assert "terminated" in p.stdout
    plan = plan_from("smoke", name="killed", data=str(wikitext_dir),
                     sets=["max_steps=120", "grid.seeds=[0]"])
    assert_sweep_complete(db, "killed", plan)
    with open_store(db) as store:
        after = store.trials("killed")
    # finished trials were not rerun (no new attempts)
    fin = {k for k, s in zip(before["trial_key"], before["status"]) if s == "terminated"}
    att_before = dict(zip(before["trial_key"], before["attempts"]))
    att_after = dict(zip(after["trial_key"], after["attempts"]))
    assert all(att_after[k] == att_before[k] for k in fin), (att_before, att_after)
    assert assert_matches_reference(db, "killed") == len(plan.trials)
    assert Path(scratch / "ray_results" / "qkgeom-killed").is_dir()


def test_baseline_fraction_arm_runs_after_its_baseline(scratch, wikitext_dir,  # noqa: F811
                                                        capsys):
    import json

    from qkgeom.plan.spec import build_plan
    from qkgeom.store import open_store
    from qkgeom.sweeps.driver import SweepOptions, run_sweep, shutdown

    spec = {"name": "bfrac", "trial": {"preset": "smoke", "overrides": {"max_steps": 40}},
            "interventions": {"depth": 1, "init": "gaussian", "arms": ["shrink"], "seeds": 1,
                              "arm_overrides": {"shrink": {"target_mode": "baseline_fraction"}}}}
    plan = build_plan(spec, data=str(wikitext_dir))
    db = f"sqlite:///{scratch}/bfrac.db"
    try:
        summary = run_sweep(plan, SweepOptions(db_url=db, storage=str(scratch / "ray"),
                                               ray_temp_dir=str(scratch / "r")))
    finally:
        shutdown()
    assert summary["errors"] == 0, summary
    # the arms phase's progress lines count the finished baseline: never "0/2 done" again
    out = capsys.readouterr().out
    arms_phase = out[out.index("arm trial(s) with baseline-relative targets"):]
    states = [ln.split("] ", 1)[1].split(" |")[0] for ln in arms_phase.splitlines()
              if " done, " in ln]
    assert states and all(s.startswith(("1/2 done", "2/2 done")) for s in states), states
    assert states[-1].startswith("2/2 done")
    with open_store(db) as store:
        trials = {r["trial_key"]: r for r in store.trials("bfrac").iter_rows(named=True)}
        base = store.sql("SELECT step, layer, value FROM probe_metrics m JOIN trials t ON "
                         "t.id = m.trial_id WHERE t.trial_key = 'd1-gaussian-none-s0' AND "
                         "metric = 'pr_wk' AND head IS NULL ORDER BY step, layer")
    cfg = json.loads(trials["d1-gaussian-shrink-s0"]["config"])
    assert cfg["baseline_pr"] == [[s, [v]] for s, _, v in base.iter_rows()]
    assert trials["d1-gaussian-shrink-s0"]["status"] == "terminated"
    assert (scratch / "ray" / "qkgeom-bfrac-arms").is_dir()


def test_existing_sweep_in_database_is_not_rerun_or_respecified(tmp_path):
    # Ray storage can be fresh (another machine, another --storage) while the database
    # already holds the sweep: a second start must not mix two runs' probes into its trials
    from qkgeom.plan.spec import plan_from
    from qkgeom.store import open_store
    from qkgeom.sweeps.driver import SweepError, prepare_db

    url = "sqlite:///" + str(tmp_path / "s.db")
    plan = plan_from("smoke", None, name="twice", data=None, sets=())
    prepare_db(plan, url, resume=False, threads=1)
    with pytest.raises(SweepError, match="--resume --name twice"):
        prepare_db(plan, url, resume=False, threads=1)
    other = plan_from("smoke", None, name="twice", data=None, sets=("max_steps=20",))
    with pytest.raises(SweepError, match="different spec"):
        prepare_db(other, url, resume=True, threads=1)
    prepare_db(plan, url, resume=True, threads=1)  # the same spec resumes
    store = open_store(url)
    try:
        spec = store.sweeps().filter(store.sweeps()["name"] == "twice")["spec"][0]
        assert json.loads(spec) == json.loads(json.dumps(plan.spec))  # stored spec untouched
    finally:
        store.close()


def test_callbacks_pickled_under_earlier_names_still_load():
    # Tune unpickles an experiment's callbacks on resume; an experiment saved before the
    # callbacks moved to qkgeom.sweeps.callbacks names them qkgeom.sweeps.driver.DbWriter/Progress
    import pickle

    from qkgeom.sweeps.callbacks import DbWriter, ProgressReporter

    old = pickle.dumps(ProgressReporter(7.0), protocol=0).replace(
        b"qkgeom.sweeps.callbacks\nProgressReporter", b"qkgeom.sweeps.driver\nProgress")
    assert b"qkgeom.sweeps.driver\nProgress\n" in old
    reporter = pickle.loads(old)
    assert type(reporter) is ProgressReporter and reporter.every_s == 7.0

    writer = DbWriter("s", direct_writes=True, keep_last=3, keep_recent_s=5.0)
    data = pickle.dumps(writer, protocol=0).replace(
        b"qkgeom.sweeps.callbacks\nDbWriter", b"qkgeom.sweeps.driver\nDbWriter")
    back = pickle.loads(data)
    assert type(back) is DbWriter
    assert (back.sweep, back.direct_writes, back.keep_last, back.keep_recent_s) == \
        ("s", True, 3, 5.0)
    # a state pickled without the lifecycle field (earlier versions) gets fresh driver state
    back.__setstate__({"sweep": "s", "direct_writes": False, "keep_last": 2,
                       "keep_recent_s": 60.0, "_store": None, "_ids": {"k": 1},
                       "_seen": {"x"}, "_ckpts": {}})
    assert back.keep_last == 2 and vars(back)["_ids"] == {} and vars(back)["_recorder"] is None
    back.on_experiment_end([])  # no store was opened: nothing to close, no error



@pytest.mark.parametrize("module", ["qkgeom.sweeps.driver", "qkgeom.tune"])
def test_what_tune_pickles_still_loads_from_the_driver_and_the_flat_path(module):
    """The driver's split moved no pickled name: the callbacks, the trainable and the
    trial name creators load from the driver's path and from 0.1.0's (qkgeom.compat)."""
    import pickle

    from qkgeom.sweeps import callbacks, trainable

    for name, obj in [("DbWriter", callbacks.DbWriter), ("Progress", callbacks.ProgressReporter),
                      ("ProgressReporter", callbacks.ProgressReporter),
                      ("trainable", trainable.trainable),
                      ("trial_dirname", trainable.trial_dirname),
                      ("trial_name", trainable.trial_name)]:
        assert pickle.loads(f"c{module}\n{name}\n.".encode()) is obj, name

def test_progress_counts_a_trial_terminated_short_of_its_steps_as_stopped(monkeypatch):
    """Tune marks every trial TERMINATED when a fit ends early (a callback error, a graceful
    stop): the line must not then claim the unfinished ones are done."""
    from types import SimpleNamespace

    from qkgeom.sweeps import callbacks as C
    from qkgeom.sweeps.state import DriverState

    def trial(key, status, step):
        return SimpleNamespace(config={"trial": {"key": key, "config": {"max_steps": 100}}},
                               status=status, last_result={"step": step} if step else {})

    monkeypatch.setattr(C, "DRIVER_STATE", DriverState(
        plan_steps={"a": 100, "b": 100, "c": 100, "d": 100}, finished_before=frozenset({"d"})))
    trials = [trial("a", "TERMINATED", 100), trial("b", "TERMINATED", 40),
              trial("c", "TERMINATED", 0)]
    state, text = C.ProgressReporter().line(trials)
    # a reached its steps; d was finished before; b and c stopped at 40 and 0 steps
    assert state == "2/4 done, 0 running, 0 failed, 0 pending, 2 stopped"
    assert "steps 240/400 (60%)" in text
    state, _ = C.ProgressReporter().line([trial("a", "TERMINATED", 100),
                                          trial("b", "RUNNING", 40)])
    assert state == "2/4 done, 1 running, 0 failed, 1 pending"  # no 'stopped' when none


def test_shutdown_stops_its_ray_and_leaves_other_children_alone():
    """A local instance started by qkgeom (its own temp dir) is stopped with every process
    under it; a child this process started for something else (a notebook's, a test's)
    keeps running. The old shutdown killed all descendants of the caller."""
    import sys

    import psutil

    from qkgeom.sweeps.ray_session import LOCAL_RAY, init_ray, shutdown

    init_ray(num_cpus=1)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        tmp = LOCAL_RAY.tmp
        assert tmp and os.path.isdir(tmp) and LOCAL_RAY.pids
        ray_procs = [c for c in psutil.Process().children(recursive=True)
                     if c.pid != other.pid and "ray" in " ".join(c.cmdline())]
        names = " ".join(" ".join(c.cmdline()) for c in ray_procs)
        assert "raylet" in names and "gcs_server" in names, names
        shutdown()
        assert other.poll() is None  # still running
        assert not [c for c in ray_procs if c.is_running() and c.status() != "zombie"]
        assert LOCAL_RAY.pids == [] and LOCAL_RAY.tmp is None and not os.path.exists(tmp)
    finally:
        other.kill()
        other.wait()
        shutdown()


def test_driver_state_resets_to_its_defaults_and_is_never_pickled():
    import pickle

    from qkgeom.store.lifecycle import HEARTBEAT_S
    from qkgeom.sweeps.state import DriverState

    state = DriverState()
    state.db_url, state.interrupted, state.in_fit = "sqlite:///x.db", "SIGTERM", True
    state.finished, state.callback_error = frozenset({"a"}), "stale"
    state.reset(heartbeat_s=2.0, plan_steps={"b": 5})
    assert state == DriverState(heartbeat_s=2.0, plan_steps={"b": 5})
    assert (state.db_url, state.interrupted, state.in_fit, state.finished,
            state.callback_error, state.say) == (None, None, False, frozenset(), None, print)
    state.reset()
    assert state.heartbeat_s == HEARTBEAT_S and state.plan_steps == {}
    with pytest.raises(TypeError, match="driver process only"):
        pickle.dumps(state)
    with pytest.raises(TypeError):  # a field name the state does not have
        state.reset(db_uri="sqlite://")


def _leave_stale_state(keys: list[str]) -> None:
    """The shared state as a first sweep in this process leaves it when a signal stopped
    it in the middle of a fit that a callback error was also ending."""
    from qkgeom.sweeps.state import DRIVER_STATE

    DRIVER_STATE.db_url = "sqlite:////nowhere/first.db"
    DRIVER_STATE.interrupted, DRIVER_STATE.in_fit, DRIVER_STATE.forwarded = "SIGTERM", True, True
    DRIVER_STATE.finished = DRIVER_STATE.finished_before = frozenset(keys)
    DRIVER_STATE.callback_error = "the first sweep's error"
    DRIVER_STATE.plan_steps, DRIVER_STATE.sweep_t0 = {"first-trial": 7}, 0.0


def test_a_refused_sweep_still_starts_from_a_clean_state(tmp_path):
    from qkgeom.plan.spec import plan_from
    from qkgeom.sweeps.driver import SweepError, SweepOptions, interrupted_by, run_sweep
    from qkgeom.sweeps.state import DRIVER_STATE, DriverState

    plan = plan_from("smoke", None, name="clean", data=None, sets=())
    _leave_stale_state([t.key for t in plan.trials])
    with pytest.raises(SweepError, match="PostgreSQL"):  # refused before anything starts
        run_sweep(plan, SweepOptions(db_url=f"sqlite:///{tmp_path}/x.db", direct_writes=True,
                                     heartbeat_s=3.0))
    steps = {t.key: int(t.config["max_steps"]) for t in plan.trials}
    assert DRIVER_STATE == DriverState(say=DRIVER_STATE.say, heartbeat_s=3.0,
                                       plan_steps=steps)
    assert interrupted_by() is None and not (tmp_path / "x.db").exists()


def test_a_second_sweep_in_the_same_process_is_not_stopped_by_the_first(scratch,  # noqa: F811
                                                                         wikitext_dir):
    """A first sweep stopped by SIGTERM leaves its signal, its finished keys and its
    callback error in the driver's state; a second ``run_sweep`` in the same process
    (a notebook, a test session) runs all of its trials and reports no interruption."""
    from qkgeom.plan.spec import build_plan
    from qkgeom.sweeps.driver import SweepOptions, interrupted_by, run_sweep, shutdown

    spec = {"name": "second", "trial": {"preset": "smoke", "overrides": {"max_steps": 20}},
            "grid": {"depths": [1], "inits": ["gaussian"], "seeds": [0]}}
    plan = build_plan(spec, data=str(wikitext_dir))
    keys = [t.key for t in plan.trials]
    assert keys == ["d1-gaussian-none-s0"]
    _leave_stale_state(keys)
    db = f"sqlite:///{scratch}/second.db"
    try:
        summary = run_sweep(plan, SweepOptions(db_url=db, storage=str(scratch / "ray"),
                                               quiet=True, num_cpus=1,
                                               ray_temp_dir=str(scratch / "r")))
    finally:
        shutdown()
    assert summary["interrupted"] is None and interrupted_by() is None
    assert summary["errors"] == 0 and summary["trials"] == {keys[0]: "terminated"}
    assert_sweep_complete(db, "second", plan)
    assert assert_matches_reference(db, "second") == 1
