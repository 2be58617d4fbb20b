"""One Tune experiment of a sweep: created over a list of trials, or restored (a resume),
then fitted with qkgeom's callbacks.

A sweep runs one experiment for its baselines and the arms that need none, and more for
arms whose targets follow a finished baseline (:mod:`qkgeom.sweeps.driver`). Which trials
an experiment may train is the database's call: those it holds as finished are skipped
(their trainable returns at once, unrecorded). A qkgeom error raised in a driver callback
ends the fit as one line that names it and the resume command, not Tune's traceback.
"""

from __future__ import annotations

from typing import Any

from ray import tune

from qkgeom.errors import QkgeomError
from qkgeom.plan.spec import SweepError, SweepPlan, TrialSpec
from qkgeom.store.lifecycle import mark_interrupted
from qkgeom.sweeps.callbacks import DbWriter, ProgressReporter
from qkgeom.sweeps.files import join_storage, stamp_directory
from qkgeom.sweeps.options import SweepOptions
from qkgeom.sweeps.resume import experiment_exists, finished_keys
from qkgeom.sweeps.state import DRIVER_STATE
from qkgeom.sweeps.trackers import tracker_callbacks
from qkgeom.sweeps.trainable import trainable, trial_dirname, trial_name


def run_experiment(plan: SweepPlan, trials: list[TrialSpec], exp_name: str,
                   opts: SweepOptions, storage: str, threads: int, gpus: float, *,
                   skip: frozenset = frozenset(), new: bool = False) -> Any:
    """One Tune experiment over ``trials``: restored when it exists (a resume), else
    created. ``skip``: keys that must not train in it (they return at once, unrecorded).
    ``new``: an experiment this run creates for trials of a resumed sweep that never ran
    in one (all of ``trials`` run, from scratch). Returns Tune's results, or None when
    nothing was left to run."""
    path = join_storage(storage, exp_name)
    restore = tune.Tuner.can_restore(path)
    if restore and not opts.resume:
        raise experiment_exists(plan.name, path)
    todo = _to_train(plan, trials, path, opts, restore=restore, skip=skip, new=new)
    if todo is None:
        return None
    trials, finished = todo
    DRIVER_STATE.finished = finished
    direct_url = DRIVER_STATE.db_url if opts.direct_writes else None
    fn = tune.with_resources(
        tune.with_parameters(trainable, db_url=direct_url, finished=finished,
                             storage_root=storage), {"cpu": opts.cpus_per_trial, "gpu": gpus})
    # whose directory this is, for qkgeom sweep delete (qkgeom.sweeps.files)
    stamp_directory(path, DRIVER_STATE.db_identity, plan.name)
    if restore:
        tuner = tune.Tuner.restore(path, fn, resume_unfinished=True, resume_errored=True)
    else:
        tuner = _new_tuner(fn, plan, trials, exp_name, opts, storage, threads)
    return _fit(tuner, plan.name)


def _to_train(plan: SweepPlan, trials: list[TrialSpec], path: str, opts: SweepOptions, *,
              restore: bool, skip: frozenset, new: bool
              ) -> tuple[list[TrialSpec], frozenset[str]] | None:
    """``(trials, finished)``: the trials of the experiment and the keys among them that
    must not train; None when a resume without its experiment finds nothing to run."""
    finished: frozenset[str] = frozenset()
    if opts.resume:  # the database, not Tune's snapshot, decides what is finished
        finished = finished_keys(DRIVER_STATE.db_url, plan.name)
    finished = finished | skip
    if new:
        return trials, frozenset()
    if not opts.resume or restore:
        return trials, finished
    # no Tune experiment here (another --storage, or it was deleted): run only what the
    # database does not hold as finished, from scratch, in a new experiment
    todo = [t for t in trials if t.key not in finished]
    say = DRIVER_STATE.say
    if not todo:
        say(f"no Ray experiment at {path}, and the database holds all {len(trials)} "
            "trial(s) as finished: nothing to run")
        return None
    if len(todo) < len(trials):
        say(f"no Ray experiment at {path}: running the {len(todo)} unfinished trial(s) "
            f"of {len(trials)} afresh; the {len(trials) - len(todo)} finished stay as "
            "stored")
    return todo, frozenset()


def _fit(tuner: Any, sweep: str) -> Any:
    """``tuner.fit()`` with the driver's signal handling on; a qkgeom error in a driver
    callback becomes one :class:`SweepError` line with the resume command."""
    DRIVER_STATE.in_fit, DRIVER_STATE.forwarded = True, False
    DRIVER_STATE.callback_error = None
    try:
        return tuner.fit()
    except (tune.TuneError, QkgeomError) as e:
        # Tune wraps most callback errors in a TuneError; one raised in on_step_begin
        # arrives as it is
        why, DRIVER_STATE.callback_error = DRIVER_STATE.callback_error, None
        if why is None:
            if not isinstance(e, QkgeomError):
                raise
            why = str(e)
        try:
            mark_interrupted(DRIVER_STATE.db_url, sweep, "the driver's error")
            marked = "are marked interrupted"
        except QkgeomError:  # the database itself may be what failed (a full disk)
            marked = "stay 'running' in the database until the resume marks them interrupted"
        raise SweepError(f"sweep {sweep} stopped: {why}; the trials that were running "
                         f"{marked}; once the cause is fixed, continue with: "
                         f"qkgeom sweep --resume --name {sweep}") from None
    finally:
        DRIVER_STATE.in_fit = False


def _with_threads(t: TrialSpec, threads: int) -> dict[str, Any]:
    d = t.to_dict()
    d["config"] = dict(t.config, threads=threads)
    return d


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
            # Tune keeps every checkpoint; DbWriter prunes them safely (see its _prune)
            checkpoint_config=tune.CheckpointConfig(num_to_keep=None),
            callbacks=[DbWriter(plan.name, opts.direct_writes,
                                keep_recent_s=opts.prune_age_s),
                       ProgressReporter(opts.progress_every_s),
                       *tracker_callbacks(opts.loggers, plan.name)],
            verbose=0,
        ),
    )
