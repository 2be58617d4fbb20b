"""Sweeps on Ray Tune: the driver, which plans, records and runs a sweep's trials.

Ray lives in four small modules: this driver, :mod:`qkgeom.sweeps.trainable` (the function
trainable each trial runs in a Ray worker), :mod:`qkgeom.sweeps.callbacks` (the
driver-side Tune callbacks and stop signals) and :mod:`qkgeom.sweeps.ray_session` (starting,
checking and stopping the Ray instance, and reaping one a killed driver left); experiment names and a sweep's files are
:mod:`qkgeom.sweeps.files`'s (no Ray), cluster files and launching :mod:`qkgeom.sweeps.cluster`'s. The trainable runs :func:`qkgeom.engine.train.train` per trial and
reports every probe through ``tune.report`` with a ``tune.Checkpoint``; a failed trial
restarts from its last checkpoint (``FailureConfig.max_failures``) and
``train(resume_from=...)`` continues with exactly the numbers an uninterrupted run
produces.

Two kinds of saved state, both in the trial's Tune storage and in the ``checkpoints``
table: *resume* checkpoints (Tune's, full training state; :class:`DbWriter` prunes
superseded ones and deletes their rows in the same callback) and weight *snapshots* at
probe steps (``<trial dir>/snapshots/step_NNNNNNN``, written by the worker through the
storage's ``pyarrow.fs`` filesystem before the step is reported; kept per the sweep's
``snapshots`` policy and never pruned).

Results reach the database through :class:`DbWriter`, a driver-side Tune callback that is
the single writer (safe for SQLite): probe rows and the trial lifecycle (pending ->
running -> error | terminated, attempts, host, device, checkpoints). With
``direct_writes`` (PostgreSQL only) the workers write their own probe rows and the
callback keeps the lifecycle.

Pitfalls settled here (see ../shared/RAY.md):

* Tune pickles the whole ``RunConfig`` (callbacks included) into the experiment state and
  brings the callbacks back from that pickle on restore, so callbacks hold no engine and
  no database URL (it may carry a password): the URL lives in
  :data:`qkgeom.sweeps.callbacks.DRIVER`, set by :func:`run_sweep` in the driver process.
* In ``on_trial_complete`` the trial still reads RUNNING: the callback writes the
  terminal state itself.
* Importing this module imports Ray; ``qkgeom --help`` and :mod:`qkgeom.plan.spec` do not.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ray import tune

from qkgeom.errors import QkgeomError
from qkgeom.plan.spec import (
    SweepError,
    SweepPlan,
    TrialSpec,
    build_plan,
)
from qkgeom.store.lifecycle import HEARTBEAT_S, mark_interrupted
from qkgeom.sweeps.callbacks import (
    DRIVER,
    DbWriter,
    ProgressReporter,
    install_signal_handlers,
    restore_signal_handlers,
)
from qkgeom.sweeps.files import (
    EXPERIMENT_PREFIX,
    STORAGE_KEY,
    arm_experiments,
    default_storage,
    experiment_path,
    join_storage,
    plain_spec,
)
from qkgeom.sweeps.ray_session import (
    check_resources,
    gpus_per_trial,
    init_ray,
    shutdown,
    warn_unplaceable,
)
from qkgeom.sweeps.trackers import check_trackers, tracker_callbacks
from qkgeom.sweeps.trainable import trainable, trial_dirname, trial_name, worker_corpus

if TYPE_CHECKING:
    from qkgeom.store import Store

__all__ = ["DbWriter", "ProgressReporter", "SweepError", "SweepOptions", "absolute_sqlite_url",
           "check_resources", "code_version", "default_storage", "experiment_path",
           "init_ray", "interrupted_by", "mark_interrupted", "plan_for_resume", "prepare_db",
           "run_sweep", "shutdown", "stored_storage", "trainable", "trial_dirname",
           "trial_name", "trial_statuses"]

# Tune unpickles an experiment's callbacks on resume, and experiments saved by earlier
# versions name them qkgeom.sweeps.driver.DbWriter and qkgeom.sweeps.driver.Progress: both still resolve.
Progress = ProgressReporter


# ---------------------------------------------------------------------- the driver
@dataclass
class SweepOptions:
    """How to run a sweep (resources, where, resume); see ``qkgeom sweep --help``."""

    db_url: str | None = None
    address: str | None = None  # join a running Ray cluster ("auto" on a head node)
    storage: str | None = None  # Tune storage root; shared storage on a multi-node cluster
    resume: bool = False
    cpus_per_trial: float = 1.0
    gpus_per_trial: float | None = None  # None: 0.25 when the cluster has GPUs, else 0
    max_concurrent: int | None = None
    max_failures: int = 2
    direct_writes: bool = False
    # superseded resume checkpoints older than this are pruned (tests shorten it)
    prune_age_s: float = 60.0
    progress_every_s: float = 10.0
    # seconds between heartbeats of the running trials (qkgeom.store.lifecycle; tests shorten it)
    heartbeat_s: float = HEARTBEAT_S
    num_cpus: int | None = None  # local Ray only (default: all cores)
    ray_temp_dir: str | None = None  # local Ray only (default: a fresh dir under /tmp)
    quiet: bool = False
    extra_env: dict[str, str] = field(default_factory=dict)
    loggers: tuple[str, ...] = ()  # opt-in trackers (qkgeom.sweeps.trackers): tensorboard, ...


def code_version() -> str:
    """``__version__+h<content hash>``: the shipped wheel's version on a cluster node."""
    from qkgeom.sweeps.ship import code_version as shipped_version

    return shipped_version()


def absolute_sqlite_url(url: str) -> str:
    """SQLite paths made absolute so that trials and later shells find the same file."""
    if url.startswith("sqlite:///") and not url.startswith("sqlite:////"):
        path = url[len("sqlite:///"):]
        if path and path != ":memory:" and not path.startswith("/"):
            return "sqlite:///" + str(Path(path).resolve())
    return url


def stored_storage(db_url: str, name: str) -> str | None:
    """The Tune storage the sweep's last run used, as recorded in the database."""
    from qkgeom.store import open_store

    with open_store(db_url, create=False, readonly=True) as store:
        spec = store.sweep_spec(name)
    return None if spec is None else spec.get(STORAGE_KEY)


def prepare_db(plan: SweepPlan, db_url: str, *, resume: bool, threads: int,
               storage: str | None = None, heartbeat_s: float | None = None
               ) -> tuple[int, int, str | None]:
    """Insert the sweep and every trial (pending) before anything runs.

    Returns ``(sweep_id, n_interrupted, code_before)``; on resume, rows a dead driver left
    ``running`` become ``interrupted`` first, and ``code_before`` is the ``code_version``
    the sweep last ran with when this run's differs (else None): ``sweeps.code_version``
    then names this run's, and each attempt keeps its own in ``trial_attempts``. ``storage`` (the Tune storage root of this run) is
    recorded in the stored spec under :data:`STORAGE_KEY`, for later resumes;
    ``heartbeat_s`` (the interval of this run's heartbeats) in ``sweeps.heartbeat_s``.
    """
    from qkgeom.store import open_store

    with open_store(db_url) as store:
        raw = store.sweep_spec(plan.name)
        _check_stored_spec(store, plan, plain_spec(raw), resume)
        storage = storage or (raw or {}).get(STORAGE_KEY)  # keep the recorded one
        spec = dict(plan.spec, **({STORAGE_KEY: storage} if storage else {}))
        sweeps = store.sweeps()
        before = dict(zip(sweeps["name"], sweeps["code_version"])).get(plan.name)
        now = code_version()
        sid = store.ensure_sweep(plan.name, spec, now, heartbeat_s=heartbeat_s)
        n_int = store.mark_running_interrupted(sid) if resume else 0
        for t in plan.trials:
            cfg = dict(t.config, threads=threads)
            store.ensure_trial(sid, t.key, cfg, depth=t.depth, init=t.init, arm=t.arm,
                               seed=t.seed, status="pending", cell=t.cell)
        return sid, n_int, before if before not in (None, now) else None


def _check_stored_spec(store: Store, plan: SweepPlan, stored: dict | None,
                       resume: bool) -> None:
    """Refuse a new sweep under a stored name, and a resume with another spec."""
    if stored is not None and not resume:
        raise SweepError(
            f"sweep {plan.name!r} already exists in {store.safe_url}; continue it with "
            f"qkgeom sweep --resume --name {plan.name} (or pick another --name: "
            "rerunning into it would mix the old and new runs' probes)")
    if stored is not None and stored != json.loads(json.dumps(plan.spec)):
        raise SweepError(
            f"sweep {plan.name!r} in {store.safe_url} was started with a different spec; "
            f"resume it as stored with qkgeom sweep --resume --name {plan.name} (no "
            "--preset/--spec/--set), or start a new --name")


def plan_for_resume(name: str, db_url: str) -> SweepPlan:
    """Rebuild the plan of sweep ``name`` from the spec stored in the database.

    Opens the database without creating it: a resume of a sweep that is not there
    leaves no new file or schema behind.
    """
    from qkgeom.store import open_store
    from qkgeom.store.engine import sqlite_path

    path = sqlite_path(db_url) if db_url.startswith("sqlite") else None
    if path is not None and not Path(path).exists():
        raise SweepError(f"no sweep named {name!r} to resume: there is no database at {path} "
                         "(check --db; start a new sweep without --resume)")
    with open_store(db_url, create=False, readonly=True) as store:
        sweeps = store.sweeps()
        row = sweeps.filter(sweeps["name"] == name)
        if row.height == 0:
            names = ", ".join(sweeps["name"].to_list()) or "none"
            raise SweepError(f"no sweep named {name!r} in {store.safe_url} (sweeps: {names}); "
                             "start it without --resume")
        spec = plain_spec(json.loads(row["spec"][0]))
    return build_plan(spec, name=name)


def _with_threads(t: TrialSpec, threads: int) -> dict[str, Any]:
    d = t.to_dict()
    d["config"] = dict(t.config, threads=threads)
    return d


def _run_phase(plan: SweepPlan, trials: list[TrialSpec], exp_name: str, opts: SweepOptions,
               storage: str, threads: int, gpus: float, *, skip: frozenset = frozenset(),
               new: bool = False) -> Any:
    """One Tune experiment over ``trials``: restored when it exists (a resume), else
    created. ``skip``: keys that must not train in it (they return at once, unrecorded).
    ``new``: an experiment this run creates for trials of a resumed sweep that never ran
    in one (all of ``trials`` run, from scratch)."""
    path = join_storage(storage, exp_name)
    resources = {"cpu": opts.cpus_per_trial, "gpu": gpus}
    direct_url = DRIVER["db_url"] if opts.direct_writes else None
    restore = tune.Tuner.can_restore(path)
    if restore and not opts.resume:
        raise SweepError(f"sweep {plan.name!r} already has a Ray experiment at {path}; "
                         f"continue it with: qkgeom sweep --resume --name {plan.name} "
                         "(or pick another --name)")
    finished = frozenset()
    if opts.resume:  # the database, not Tune's snapshot, decides what is finished
        statuses = trial_statuses(DRIVER["db_url"], plan.name)
        finished = frozenset(k for k, v in statuses.items() if v == "terminated")
    finished = finished | skip
    if new:
        finished = frozenset()
    elif opts.resume and not restore:
        # no Tune experiment here (another --storage, or it was deleted): run only what
        # the database does not hold as finished, from scratch, in a new experiment
        todo = [t for t in trials if t.key not in finished]
        say = DRIVER.get("say", print)
        if not todo:
            say(f"no Ray experiment at {path}, and the database holds all {len(trials)} "
                "trial(s) as finished: nothing to run")
            return None
        if len(todo) < len(trials):
            say(f"no Ray experiment at {path}: running the {len(todo)} unfinished trial(s) "
                f"of {len(trials)} afresh; the {len(trials) - len(todo)} finished stay as "
                "stored")
        trials = todo
        finished = frozenset()
    DRIVER["finished"] = finished
    fn = tune.with_resources(
        tune.with_parameters(trainable, db_url=direct_url, finished=finished,
                             storage_root=storage), resources)
    if restore:
        tuner = tune.Tuner.restore(path, fn, resume_unfinished=True, resume_errored=True)
    else:
        tuner = _new_tuner(fn, plan, trials, exp_name, opts, storage, threads)
    DRIVER["in_fit"], DRIVER["forwarded"] = True, False
    DRIVER.pop("callback_error", None)
    try:
        return tuner.fit()
    except (tune.TuneError, QkgeomError) as e:
        # a qkgeom error in a driver callback: one line, not Tune's text (Tune wraps most
        # callback errors in a TuneError; one raised in on_step_begin arrives as it is)
        why = DRIVER.pop("callback_error", None)
        if why is None:
            if not isinstance(e, QkgeomError):
                raise
            why = str(e)
        try:
            mark_interrupted(DRIVER["db_url"], plan.name, "the driver's error")
            marked = "are marked interrupted"
        except QkgeomError:  # the database itself may be what failed (a full disk)
            marked = "stay 'running' in the database until the resume marks them interrupted"
        raise SweepError(f"sweep {plan.name} stopped: {why}; the trials that were running "
                         f"{marked}; once the cause is fixed, continue with: "
                         f"qkgeom sweep --resume --name {plan.name}") from None
    finally:
        DRIVER["in_fit"] = False


def _new_tuner(fn: Any, plan: SweepPlan, trials: list[TrialSpec], exp_name: str,
               opts: SweepOptions, storage: str, threads: int) -> Any:
    """A fresh Tune experiment ``exp_name`` over ``trials``, with qkgeom's callbacks."""
    space = {"trial": tune.grid_search([_with_threads(t, threads) for t in trials]),
             "sweep": plan.name, "snapshots": plan.snapshots}
    return tune.Tuner(
        fn,
        param_space=space,
        tune_config=tune.TuneConfig(
            max_concurrent_trials=opts.max_concurrent or None,
            trial_dirname_creator=trial_dirname,
            trial_name_creator=trial_name,
            # one process per concurrent slot: torch/ray imports (~7 s) paid once
            reuse_actors=True,
        ),
        run_config=tune.RunConfig(
            name=exp_name,
            storage_path=storage,
            failure_config=tune.FailureConfig(max_failures=opts.max_failures),
            # Tune keeps every checkpoint; DbWriter prunes them safely (see _prune)
            checkpoint_config=tune.CheckpointConfig(num_to_keep=None),
            callbacks=[DbWriter(plan.name, opts.direct_writes,
                                keep_recent_s=opts.prune_age_s),
                       ProgressReporter(opts.progress_every_s),
                       *tracker_callbacks(opts.loggers, plan.name)],
            verbose=0,
        ),
    )


def interrupted_by() -> str | None:
    """The signal (``SIGINT``, ``SIGTERM``) that stopped the last sweep, or None."""
    return DRIVER.get("interrupted")


def run_sweep(plan: SweepPlan, opts: SweepOptions) -> dict[str, Any]:
    """Run (or resume) ``plan`` on Ray Tune, writing results to ``opts.db_url``.

    Returns a summary: ``{"name", "wall_s", "trials": {key: status}, "errors": n}``.
    """
    from qkgeom.store import resolve_url

    t0 = time.perf_counter()
    db_url = absolute_sqlite_url(resolve_url(opts.db_url))
    if opts.direct_writes and not db_url.startswith("postgresql"):
        raise SweepError("--direct-writes needs a PostgreSQL database: SQLite cannot take "
                         "concurrent writers from many Ray workers; drop --direct-writes to "
                         "let the driver write (the default)")
    storage = str(Path(opts.storage or default_storage()).expanduser().resolve()
                  if "://" not in (opts.storage or "") else opts.storage)
    threads = max(1, int(opts.cpus_per_trial))
    path = experiment_path(plan.name, storage)
    if opts.resume and opts.storage is None:  # no --storage: the one the sweep ran with
        try:
            storage = stored_storage(db_url, plan.name) or storage
        except QkgeomError:
            pass
        path = experiment_path(plan.name, storage)
    if opts.resume:
        _check_resume_storage(plan.name, db_url, storage)
    if not opts.resume and tune.Tuner.can_restore(path):  # refuse before starting Ray
        raise SweepError(f"sweep {plan.name!r} already has a Ray experiment at {path}; "
                         f"continue it with: qkgeom sweep --resume --name {plan.name} "
                         "(or pick another --name)")
    check_trackers(opts.loggers, direct_writes=opts.direct_writes)
    check_resources(opts)  # before anything is created or started
    # local Ray: the corpus is downloaded and encoded here, once, before any trial starts (a
    # bad --data fails here). On a cluster the first trial on each node does it and the
    # node's other trials wait on the cache's lock (qkgeom.engine.data), then open the result.
    if opts.address is None:
        for dataset in sorted({t.config.get("dataset", "default") for t in plan.trials}):
            worker_corpus(dataset)
    sid, n_int, code_before = prepare_db(plan, db_url, resume=opts.resume, threads=threads,
                                         storage=storage, heartbeat_s=opts.heartbeat_s)
    say = (lambda *a: None) if opts.quiet else (lambda *a: print(*a, flush=True))
    if n_int:
        say(f"marked {n_int} trial(s) left running by a dead driver as interrupted")
    if code_before:
        say(f"sweep {plan.name} ran with qkgeom {code_before}; this resume runs "
            f"{code_version()} (each trial attempt records its own in trial_attempts)")
    DRIVER["db_url"] = db_url
    DRIVER["storage"] = storage
    DRIVER["say"] = say
    DRIVER["heartbeat_s"] = opts.heartbeat_s
    for k in ("interrupted", "forwarded", "callback_error"):
        DRIVER.pop(k, None)
    DRIVER["plan_steps"] = {t.key: int(t.config["max_steps"]) for t in plan.trials}
    DRIVER["sweep_t0"] = time.monotonic()  # the progress line's clock, across both phases
    DRIVER["finished_before"] = frozenset(
        k for k, v in trial_statuses(db_url, plan.name).items() if v == "terminated")
    try:
        return _run(plan, opts, db_url, storage, threads, sid, t0, say)
    except (KeyboardInterrupt, SystemExit) as e:
        # SystemExit(15): a SIGTERM inside ray.init, whose core worker handles it with
        # sys.exit before the sweep's own handler is back: the same stop as ours
        if isinstance(e, SystemExit):
            if e.code != signal.SIGTERM:
                raise
            DRIVER.setdefault("interrupted", "SIGTERM")
        why = DRIVER.get("interrupted") or "SIGINT"
        try:
            mark_interrupted(db_url, plan.name, why)
        except Exception:  # the record is best effort on a hard stop; resume fixes it
            pass
        if isinstance(e, SystemExit):
            raise KeyboardInterrupt from None
        raise
    finally:
        restore_signal_handlers(DRIVER.pop("old_handlers", {}))


def _check_resume_storage(name: str, db_url: str, storage: str) -> None:
    """Refuse a resume pointed at the wrong Tune storage while the sweep's experiment
    exists at the storage its last run recorded (it would lose the trials' checkpoints)."""
    try:
        first = stored_storage(db_url, name)
    except QkgeomError:
        return  # no database or no sweep yet: nothing recorded
    if not first or first == storage or tune.Tuner.can_restore(experiment_path(name, storage)):
        return
    try:
        there = tune.Tuner.can_restore(experiment_path(name, first))
    except Exception:  # unreachable storage: resume here, from the database
        there = False
    if there:
        raise SweepError(f"sweep {name!r} ran with --storage {first}, where its Ray "
                         f"experiment is; resume it with: qkgeom sweep --resume --name {name} "
                         f"--storage {first}")


def _run(plan: SweepPlan, opts: SweepOptions, db_url: str, storage: str, threads: int,
         sid: int, t0: float, say: Any) -> dict[str, Any]:
    from qkgeom.store import safe_url

    init_ray(opts)
    # after ray.init, whose core worker installs its own SIGTERM handler (it logs and dies)
    DRIVER["old_handlers"] = install_signal_handlers()
    gpus = gpus_per_trial(opts)
    if opts.address is not None:
        warn_unplaceable(opts.cpus_per_trial, gpus, say)
    say(f"sweep {plan.name}: {len(plan.trials)} trials, {opts.cpus_per_trial:g} CPU and "
        f"{gpus:g} GPU per trial, database {safe_url(db_url)}, Ray storage "
        f"{experiment_path(plan.name, storage)}")
    first = [t for t in plan.trials if not t.needs_baseline]
    later = [t for t in plan.trials if t.needs_baseline]
    _run_phase(plan, first, f"{EXPERIMENT_PREFIX}{plan.name}", opts, storage, threads, gpus)
    waiting: dict[str, str] = {}
    if later and not DRIVER.get("interrupted"):
        waiting = _run_arms(plan, later, opts, db_url, storage, threads, gpus, say)
    why = DRIVER.get("interrupted")
    if why:
        mark_interrupted(db_url, plan.name, why)
    statuses = trial_statuses(db_url, plan.name)
    return {"name": plan.name, "wall_s": time.perf_counter() - t0, "trials": statuses,
            "errors": sum(1 for s in statuses.values() if s != "terminated"),
            "db_url": db_url, "sweep_id": sid, "interrupted": why, "waiting": waiting}


def _run_arms(plan: SweepPlan, later: list[TrialSpec], opts: SweepOptions, db_url: str,
              storage: str, threads: int, gpus: float, say: Any) -> dict[str, str]:
    """The arm phase: arms whose target is a fraction of their paired baseline's trajectory
    run only against a finished baseline (:mod:`qkgeom.plan.pairing`). Arms an earlier run
    placed in a Tune experiment continue there (restored from their checkpoints); arms
    that could not run before, and stale ones, run afresh in a new experiment. Returns the
    arms still waiting for their baseline (key -> reason)."""
    from qkgeom.plan import pairing
    from qkgeom.store import open_store

    with open_store(db_url) as store:
        arms = pairing.arrange_arms(store, plan.name, later)
        pairing.record_plan(store, plan.name, arms, later, threads)
    for key, why in sorted(arms.waiting.items()):
        say(f"arm {key}: {why}; it runs once the baseline has finished")
    for key, why in sorted(arms.stale.items()):
        say(f"arm {key}: {why}")
    if not arms.run:
        return arms.waiting
    # the progress line counts the first phase's finished trials as done
    DRIVER["finished_before"] = frozenset(
        k for k, v in trial_statuses(db_url, plan.name).items() if v == "terminated")
    say(f"sweep {plan.name}: {len(arms.run)} arm trial(s) with baseline-relative targets")
    run_keys = {t.key for t in arms.run}
    names = arm_experiments(plan.name)
    used: set[str] = set()
    fresh = [t for t in arms.run if t.key in arms.stale or not arms.experiments.get(t.key)]
    groups: dict[str, list[TrialSpec]] = {}
    for t in arms.run:
        exp = arms.experiments.get(t.key)
        if t.key in arms.stale or not exp:
            continue
        if tune.Tuner.can_restore(join_storage(storage, exp)):
            groups.setdefault(exp, []).append(t)
        else:  # recorded, but its experiment is gone (another --storage, deleted)
            fresh.append(t)
    for exp, ts in groups.items():  # continue each earlier arm experiment
        used.add(exp)
        # its other members (finished, stale, waiting) must not run there again
        skip = frozenset(k for k in run_keys | set(arms.waiting) if k not in
                         {t.key for t in ts})
        _run_phase(plan, ts, exp, opts, storage, threads, gpus, skip=skip)
        if DRIVER.get("interrupted"):
            return arms.waiting
    if fresh:
        taken = _recorded_experiments(db_url, plan.name) | used
        exp = next(n for n in names
                   if n not in taken and not tune.Tuner.can_restore(join_storage(storage, n)))
        with open_store(db_url) as store:
            pairing.set_experiment(store, plan.name, arms, [t.key for t in fresh], exp)
        _run_phase(plan, fresh, exp, opts, storage, threads, gpus, new=True)
    return arms.waiting


def _recorded_experiments(db_url: str, sweep: str) -> set[str]:
    from qkgeom.store import open_store

    with open_store(db_url) as store:
        refs = store.trials(sweep)["baseline_ref"].to_list()
    return {json.loads(r).get("experiment") for r in refs if r} - {None}


def trial_statuses(db_url: str, sweep: str) -> dict[str, str]:
    from qkgeom.store import open_store

    with open_store(db_url) as store:
        df = store.trials(sweep)
    return dict(zip(df["trial_key"].to_list(), df["status"].to_list()))


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: qkgeom sweep --help")
