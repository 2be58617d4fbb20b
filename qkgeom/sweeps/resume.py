"""A sweep's record before it runs: a new sweep recorded, or a stored one resumed.

The database, not Tune's experiment snapshot, decides what a sweep is: its stored spec
(a resume runs exactly that plan), the Tune storage its last run used (a resume finds
its experiment there) and which trials are finished (never trained again). A new sweep
under a name the database or the storage already holds is refused with the command that
continues it instead.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ray import tune

from qkgeom.errors import QkgeomError
from qkgeom.plan.spec import SweepError, SweepPlan, build_plan
from qkgeom.sweeps.files import STORAGE_KEY, experiment_path, plain_spec

if TYPE_CHECKING:
    from qkgeom.store import Store


def code_version() -> str:
    """``__version__+h<content hash>``: the shipped wheel's version on a cluster node."""
    from qkgeom.sweeps.ship import code_version as shipped_version

    return shipped_version()


def stored_storage(db_url: str, name: str) -> str | None:
    """The Tune storage the sweep's last run used, as recorded in the database."""
    from qkgeom.store import open_store

    with open_store(db_url, create=False, readonly=True) as store:
        spec = store.sweep_spec(name)
    return None if spec is None else spec.get(STORAGE_KEY)


def resume_storage(name: str, db_url: str, storage: str, given: bool) -> str:
    """The Tune storage a resume runs with: ``storage`` when it was ``given``
    (``--storage``), else the one the sweep last ran with (``storage`` if none is
    recorded). Refuses a given storage that would lose the experiment's checkpoints."""
    if not given:
        try:
            storage = stored_storage(db_url, name) or storage
        except QkgeomError:
            pass
    check_resume_storage(name, db_url, storage)
    return storage


def check_resume_storage(name: str, db_url: str, storage: str) -> None:
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


def experiment_exists(name: str, path: str) -> SweepError:
    """The refusal of a new (not resumed) sweep over the Tune experiment at ``path``."""
    return SweepError(f"sweep {name!r} already has a Ray experiment at {path}; "
                      f"continue it with: qkgeom sweep --resume --name {name} "
                      "(or pick another --name)")


def prepare_db(plan: SweepPlan, db_url: str, *, resume: bool, threads: int,
               storage: str | None = None, heartbeat_s: float | None = None,
               take_lease: Callable[[Store, int], None] | None = None,
               ) -> tuple[int, int, str | None]:
    """Insert the sweep and every trial (pending) before anything runs.

    Returns ``(sweep_id, n_interrupted, code_before)``; on resume, rows a dead driver left
    ``running`` become ``interrupted`` first, and ``code_before`` is the ``code_version``
    the sweep last ran with when this run's differs (else None): ``sweeps.code_version``
    then names this run's, and each attempt keeps its own in ``trial_attempts``.
    ``storage`` (the Tune storage root of this run) is recorded in the stored spec under
    :data:`STORAGE_KEY`, for later resumes; ``heartbeat_s`` (the interval of this run's
    heartbeats) in ``sweeps.heartbeat_s``. ``take_lease(store, sweep_id)`` runs once the
    sweep is recorded and before any trial is touched: the driver takes the sweep's lease
    there (:mod:`qkgeom.store.lease`), so a live driver's trials are never marked
    interrupted by a second one.
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
        if take_lease is not None:
            take_lease(store, sid)
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


def trial_statuses(db_url: str, sweep: str) -> dict[str, str]:
    """Each trial's status in the database, by key."""
    from qkgeom.store import open_store

    with open_store(db_url) as store:
        df = store.trials(sweep)
    return dict(zip(df["trial_key"].to_list(), df["status"].to_list()))


def finished_keys(db_url: str, sweep: str) -> frozenset[str]:
    """The keys of the trials the database holds as finished (``terminated``)."""
    return frozenset(k for k, v in trial_statuses(db_url, sweep).items() if v == "terminated")
