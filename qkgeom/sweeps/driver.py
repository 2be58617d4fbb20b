"""Sweeps on Ray Tune: the driver, which runs a sweep's plan from start to summary.

:func:`run_sweep` checks the options (:mod:`qkgeom.sweeps.options`), records the sweep or
finds it for a resume (:mod:`qkgeom.sweeps.resume`), starts Ray
(:mod:`qkgeom.sweeps.ray_session`) and runs the plan in phases, each one Tune experiment
(:mod:`qkgeom.sweeps.experiment`): the baselines and the arms that need none, then the arms
whose targets follow a finished baseline. Each trial runs
:func:`qkgeom.sweeps.trainable.trainable` in a Ray worker; the driver-side callbacks
(:mod:`qkgeom.sweeps.callbacks`) write the database and print the progress line.
Experiment names and a sweep's files are :mod:`qkgeom.sweeps.files`'s (no Ray), cluster
files and launching :mod:`qkgeom.sweeps.cluster`'s.

A failed trial restarts from its last checkpoint (``FailureConfig.max_failures``) and
``train(resume_from=...)`` continues with exactly the numbers an uninterrupted run
produces. Two kinds of saved state, both in the trial's Tune storage and in the
``checkpoints`` table: *resume* checkpoints (Tune's, full training state; :class:`DbWriter`
prunes superseded ones and deletes their rows in the same callback) and weight *snapshots*
at probe steps (``<trial dir>/snapshots/step_NNNNNNN``, kept per the sweep's
``snapshots`` policy and never pruned).

Pitfalls settled here (see ../shared/RAY.md):

* Tune pickles the whole ``RunConfig`` (callbacks included) into the experiment state and
  brings the callbacks back from that pickle on restore, so callbacks hold no engine and
  no database URL (it may carry a password): the URL lives in
  :data:`qkgeom.sweeps.state.DRIVER_STATE`, which :func:`run_sweep` resets and fills in
  the driver process.
* In ``on_trial_complete`` the trial still reads RUNNING: the callback writes the
  terminal state itself.
* Importing this module imports Ray; ``qkgeom --help`` and :mod:`qkgeom.plan.spec` do not.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from typing import Any

from ray import tune

from qkgeom.plan.spec import SweepError, SweepPlan, TrialSpec
from qkgeom.store.lease import LeaseKeeper, acquire, database_identity, refuse_beside_live_driver
from qkgeom.store.lifecycle import STALE_AFTER, mark_interrupted
from qkgeom.sweeps.callbacks import (
    DbWriter,
    ProgressReporter,
    install_signal_handlers,
    restore_signal_handlers,
    signals_seen_during_ray_start,
    stop_if_signalled,
)
from qkgeom.sweeps.experiment import run_experiment
from qkgeom.sweeps.files import (
    EXPERIMENT_PREFIX,
    arm_experiments,
    default_storage,
    experiment_path,
    join_storage,
)
from qkgeom.sweeps.options import (
    SweepOptions,
    absolute_sqlite_url,
    check_direct_writes,
    check_resources,
    gpus_per_trial,
    storage_root,
)
from qkgeom.sweeps.ray_session import init_ray, shutdown, warn_unplaceable
from qkgeom.sweeps.resume import (
    code_version,
    experiment_exists,
    finished_keys,
    plan_for_resume,
    prepare_db,
    resume_storage,
    stored_storage,
    trial_statuses,
)
from qkgeom.sweeps.state import DRIVER_STATE
from qkgeom.sweeps.trackers import check_trackers
from qkgeom.sweeps.trainable import trainable, trial_dirname, trial_name, worker_corpus

__all__ = ["DbWriter", "ProgressReporter", "SweepError", "SweepOptions", "absolute_sqlite_url",
           "check_resources", "code_version", "default_storage", "experiment_path",
           "init_ray", "install_signal_handlers", "interrupted_by", "mark_interrupted",
           "plan_for_resume", "prepare_db", "restore_signal_handlers", "run_sweep",
           "shutdown", "stored_storage", "trainable", "trial_dirname", "trial_name",
           "trial_statuses"]

# Tune unpickles an experiment's callbacks on resume, and experiments saved by earlier
# versions name them qkgeom.sweeps.driver.DbWriter and qkgeom.sweeps.driver.Progress: both
# still resolve (and, through qkgeom.compat, qkgeom.tune.DbWriter and qkgeom.tune.Progress).
Progress = ProgressReporter


def interrupted_by() -> str | None:
    """The signal (``SIGINT``, ``SIGTERM``) that stopped the last sweep, or None."""
    return DRIVER_STATE.interrupted


def run_sweep(plan: SweepPlan, opts: SweepOptions) -> dict[str, Any]:
    """Run (or resume) ``plan`` on Ray Tune, writing results to ``opts.db_url``.

    Returns a summary: ``{"name", "wall_s", "trials": {key: status}, "errors": n}``.
    """
    t0 = time.perf_counter()
    say = (lambda *a: None) if opts.quiet else (lambda *a: print(*a, flush=True))
    # every sweep starts from a clean state: nothing of an earlier one in this process
    # (its signal, finished keys, callback error) carries over
    DRIVER_STATE.reset(say=say, heartbeat_s=opts.heartbeat_s,
                       plan_steps={t.key: int(t.config["max_steps"]) for t in plan.trials})
    db_url, storage, threads = _checked(plan, opts)
    # local Ray: the corpus is downloaded and encoded here, once, before any trial starts (a
    # bad --data fails here). On a cluster the first trial on each node does it and the
    # node's other trials wait on the cache's lock (qkgeom.engine.data), then open the result.
    if opts.address is None:
        for dataset in sorted({t.config.get("dataset", "default") for t in plan.trials}):
            worker_corpus(dataset)
    taken: dict[str, Any] = {}

    def take_lease(store: Any, sweep_id: int) -> None:
        token, old = acquire(store, sweep_id, plan.name, command=_command(opts),
                             stale_after_s=STALE_AFTER * opts.heartbeat_s)
        taken.update(token=token, old=old, identity=database_identity(store))

    sid, n_int, code_before = prepare_db(plan, db_url, resume=opts.resume, threads=threads,
                                         storage=storage, heartbeat_s=opts.heartbeat_s,
                                         take_lease=take_lease)
    keeper = LeaseKeeper(db_url, sid, taken["token"], opts.heartbeat_s,
                         on_lost=_lease_lost).start()
    old = taken["old"]
    if old is not None:
        say(f"took over sweep {plan.name} from its earlier driver (pid {old.pid} on "
            f"{old.host}: {old.gone()})")
    if n_int:
        say(f"marked {n_int} trial(s) left running by a dead driver as interrupted")
    if code_before:
        say(f"sweep {plan.name} ran with qkgeom {code_before}; this resume runs "
            f"{code_version()} (each trial attempt records its own in trial_attempts)")
    DRIVER_STATE.db_url, DRIVER_STATE.storage = db_url, storage
    DRIVER_STATE.db_identity = taken["identity"]
    DRIVER_STATE.sweep_t0 = time.monotonic()  # the progress line's clock, across both phases
    DRIVER_STATE.finished_before = finished_keys(db_url, plan.name)
    try:
        return _run(plan, opts, db_url, storage, threads, sid, t0, keeper)
    except (KeyboardInterrupt, SystemExit) as e:
        # SystemExit(15): a SIGTERM inside ray.init, whose core worker handles it with
        # sys.exit before the sweep's own handler is back: the same stop as ours
        if isinstance(e, SystemExit):
            if e.code != signal.SIGTERM:
                raise
            DRIVER_STATE.interrupted = DRIVER_STATE.interrupted or "SIGTERM"
        try:
            if not keeper.lost:  # another driver runs the sweep now: its trials are its own
                mark_interrupted(db_url, plan.name, DRIVER_STATE.interrupted or "SIGINT")
        except Exception:  # the record is best effort on a hard stop; resume fixes it
            pass
        if isinstance(e, SystemExit):
            raise KeyboardInterrupt from None
        raise
    finally:
        keeper.stop()
        handlers, DRIVER_STATE.old_handlers = DRIVER_STATE.old_handlers, {}
        restore_signal_handlers(handlers)


def _command(opts: SweepOptions) -> str:
    """How the lease names this driver: ``qkgeom sweep [--resume] --name NAME``."""
    return "qkgeom sweep" + (" --resume" if opts.resume else "")


def _lease_lost() -> None:
    """Another driver took the sweep (this one was stale: stopped, suspended or cut off
    for longer than the lease allows): stop as on SIGTERM, without marking its trials."""
    import os

    os.kill(os.getpid(), signal.SIGTERM)


def _checked(plan: SweepPlan, opts: SweepOptions) -> tuple[str, str, int]:
    """``(database URL, Tune storage, threads per trial)`` of this run, after every check
    that needs neither Ray nor the corpus (nothing is created or started before them)."""
    from qkgeom.store import resolve_url

    db_url = absolute_sqlite_url(resolve_url(opts.db_url))
    check_direct_writes(opts, db_url)
    storage = storage_root(opts)
    threads = max(1, int(opts.cpus_per_trial))
    if opts.resume:  # without --storage: the one the sweep ran with
        refuse_beside_live_driver(db_url, plan.name)  # at once, before the corpus is read
        storage = resume_storage(plan.name, db_url, storage, given=opts.storage is not None)
    elif tune.Tuner.can_restore(experiment_path(plan.name, storage)):  # before Ray starts
        raise experiment_exists(plan.name, experiment_path(plan.name, storage))
    check_trackers(opts.loggers, direct_writes=opts.direct_writes)
    check_resources(opts)
    return db_url, storage, threads


def _run(plan: SweepPlan, opts: SweepOptions, db_url: str, storage: str, threads: int,
         sid: int, t0: float, keeper: LeaseKeeper) -> dict[str, Any]:
    """Ray started, the two phases run; the end-of-sweep summary from the database."""
    from qkgeom.store import safe_url

    say = DRIVER_STATE.say
    with signals_seen_during_ray_start():
        init_ray(opts.address, num_cpus=opts.num_cpus, temp_dir=opts.ray_temp_dir,
                 env=opts.extra_env, say=say)
    # after ray.init, whose core worker installs its own SIGTERM handler (it logs and dies)
    DRIVER_STATE.old_handlers = install_signal_handlers()
    stop_if_signalled()
    gpus = gpus_per_trial(opts)
    if opts.address is not None:
        warn_unplaceable(opts.cpus_per_trial, gpus, say)
    say(f"sweep {plan.name}: {len(plan.trials)} trials, {opts.cpus_per_trial:g} CPU and "
        f"{gpus:g} GPU per trial, database {safe_url(db_url)}, Ray storage "
        f"{experiment_path(plan.name, storage)}")
    first = [t for t in plan.trials if not t.needs_baseline]
    later = [t for t in plan.trials if t.needs_baseline]
    run_experiment(plan, first, f"{EXPERIMENT_PREFIX}{plan.name}", opts, storage, threads,
                   gpus)
    waiting: dict[str, str] = {}
    if later and not DRIVER_STATE.interrupted:
        waiting = _run_arms(plan, later, opts, db_url, storage, threads, gpus)
    why = DRIVER_STATE.interrupted
    if why and not keeper.lost:
        mark_interrupted(db_url, plan.name, why)
    statuses = trial_statuses(db_url, plan.name)
    return {"name": plan.name, "wall_s": time.perf_counter() - t0, "trials": statuses,
            "errors": sum(1 for s in statuses.values() if s != "terminated"),
            "db_url": db_url, "sweep_id": sid, "interrupted": why, "waiting": waiting}


def _run_arms(plan: SweepPlan, later: list[TrialSpec], opts: SweepOptions, db_url: str,
              storage: str, threads: int, gpus: float) -> dict[str, str]:
    """The arm phase: arms whose target is a fraction of their paired baseline's trajectory
    run only against a finished baseline (:mod:`qkgeom.plan.pairing`). Arms an earlier run
    placed in a Tune experiment continue there (restored from their checkpoints); arms
    that could not run before, and stale ones, run afresh in a new experiment. Returns the
    arms still waiting for their baseline (key -> reason)."""
    from qkgeom.plan import pairing
    from qkgeom.store import open_store

    say = DRIVER_STATE.say
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
    DRIVER_STATE.finished_before = finished_keys(db_url, plan.name)
    say(f"sweep {plan.name}: {len(arms.run)} arm trial(s) with baseline-relative targets")
    run_keys = {t.key for t in arms.run}
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
        run_experiment(plan, ts, exp, opts, storage, threads, gpus, skip=skip)
        if DRIVER_STATE.interrupted:
            return arms.waiting
    if fresh:
        taken = _recorded_experiments(db_url, plan.name) | used
        exp = next(n for n in arm_experiments(plan.name)
                   if n not in taken and not tune.Tuner.can_restore(join_storage(storage, n)))
        with open_store(db_url) as store:
            pairing.set_experiment(store, plan.name, arms, [t.key for t in fresh], exp)
        run_experiment(plan, fresh, exp, opts, storage, threads, gpus, new=True)
    return arms.waiting


def _recorded_experiments(db_url: str, sweep: str) -> set[str]:
    """The arm experiments the database names for the sweep's trials."""
    from qkgeom.store import open_store

    with open_store(db_url) as store:
        refs = store.trials(sweep)["baseline_ref"].to_list()
    return {json.loads(r).get("experiment") for r in refs if r} - {None}


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: qkgeom sweep --help")
