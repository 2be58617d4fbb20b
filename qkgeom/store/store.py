"""The :class:`Store`: every read and write of results goes through here.

Writes are one transaction per call, batched (``executemany``), and idempotent on natural
keys through the dialect's ``INSERT ... ON CONFLICT DO UPDATE``: writing a record again
(a retry, a resumed trial) leaves exactly one row with the latest values. Reads return
polars DataFrames or plain dataclasses, never ORM rows.

The class is assembled from parts: connections and upsert plumbing
(:mod:`qkgeom.store.base`), result writes (:mod:`qkgeom.store.writes`), reads and export
(:mod:`qkgeom.store.reads`); sweeps and the trial lifecycle live here.
"""

from __future__ import annotations

from typing import Any

from qkgeom.errors import QkgeomError
from qkgeom.store.base import ReadOnlyError, check_status, now_utc, stored_float
from qkgeom.store.engine import connect_error, make_engine, resolve_url, safe_url, sqlite_path
from qkgeom.store.models import (
    TERMINAL,
    Checkpoint,
    Probe,
    ProbeMetric,
    Sweep,
    TrainStep,
    Trial,
    TrialAttempt,
)
from qkgeom.store.reads import ExportedFile, Reads, TrialInfo
from qkgeom.store.schema import SchemaError, inspect_state, refusal, upgrade
from qkgeom.store.writes import METRIC_COLUMNS, ResultWrites

__all__ = ["METRIC_COLUMNS", "ExportedFile", "ReadOnlyError", "Store", "TrialInfo", "open_store",
           "read_sql"]


def open_store(url: str | None = None, *, create: bool = True, readonly: bool = False) -> Store:
    """Open the results database at ``url`` (see :func:`resolve_url` for the default).

    A new or empty database is created at the newest schema revision (``create=True``);
    an out-of-date one is refused with the ``qkgeom db upgrade`` command to run; one from
    a newer qkgeom is refused. ``readonly`` refuses writes at the database level.
    """
    url = resolve_url(url)
    from sqlalchemy.exc import SQLAlchemyError

    engine = make_engine(url, create=create, readonly=readonly)
    try:
        with engine.connect() as conn:
            state = inspect_state(conn)
        if state.verdict == "empty":
            if not create or readonly:
                raise SchemaError(
                    f"database {safe_url(url)} has no qkgeom schema; create it with: "
                    f"qkgeom db upgrade --db {safe_url(url)}"
                )
            # under a lock, so a concurrent creator is fine; an in-memory database
            # exists only inside this engine, so migrate through it
            memory = engine.dialect.name == "sqlite" and sqlite_path(url) is None
            _, state = upgrade(url, engine=engine if memory else None)
        err = refusal(state, url)
        if err is not None:
            raise err
    except SQLAlchemyError as e:
        engine.dispose()
        raise connect_error(e, url) from None
    except BaseException:
        engine.dispose()
        raise
    return Store(engine, url, revision=state.head, readonly=readonly)


def read_sql(url: str | None, query: str, params: dict | None = None) -> Any:
    """Run one read-only query against the database at ``url``; a polars DataFrame."""
    with open_store(url, create=False, readonly=True) as store:
        return store.sql(query, params)


class Store(ResultWrites, Reads):
    """An open results database. Not picklable (it holds an engine): pass the URL to
    other processes and call :func:`open_store` there. Close with :meth:`close`."""
    # ------------------------------------------------------------------ sweeps, trials
    def ensure_sweep(self, name: str, spec: dict, code_version: str, *,
                     heartbeat_s: float | None = None) -> int:
        """The id of sweep ``name``, created if new; spec, code_version and heartbeat_s (the
        seconds between its running trials' heartbeats, None for none) are updated."""
        from sqlalchemy import select

        from qkgeom.store.models import DatabaseInfo

        info = DatabaseInfo.__table__
        # a new sweep's files are this database's (sweeps.origin; db merge carries it)
        here = select(info.c.value).where(info.c.key == "identity").scalar_subquery()
        ins = self._insert(Sweep.__table__).values(
            name=name, spec=spec, code_version=code_version, created_at=now_utc(),
            heartbeat_s=heartbeat_s, origin=here,
        )
        stmt = ins.on_conflict_do_update(
            index_elements=["name"],
            set_={"spec": ins.excluded.spec, "code_version": ins.excluded.code_version,
                  "heartbeat_s": ins.excluded.heartbeat_s},
        ).returning(Sweep.__table__.c.id)
        with self._write() as conn:
            sweep_id = conn.execute(stmt).scalar_one()
            self._sync_metric_definitions(conn)
        return int(sweep_id)

    def ensure_trial(self, sweep_id: int, trial_key: str, config: dict, *, depth: int,
                     init: str, arm: str, seed: int, status: str = "pending",
                     reset: bool = False, cell: str | None = None) -> int:
        """The id of trial ``(sweep_id, trial_key)``, created with ``status`` if new.

        An existing trial gets the new config and promoted columns but keeps its status,
        attempts, error, times and results, unless ``reset=True``, which sets ``status``,
        clears attempts, error, times, test loss and baseline reference, and deletes its
        probes, metrics, training steps and checkpoints.
        """
        check_status(status)
        t = Trial.__table__
        ins = self._insert(t).values(
            sweep_id=sweep_id, trial_key=trial_key, config=config, depth=int(depth),
            init=init, arm=arm, seed=int(seed), status=status, attempts=0, created_at=now_utc(),
            cell=cell,
        )
        update = {c: ins.excluded[c] for c in ("config", "depth", "init", "arm", "seed", "cell")}
        if reset:
            update.update(status=ins.excluded.status, attempts=0, error=None, started_at=None,
                          ended_at=None, test_loss=None, baseline_ref=None)
        stmt = ins.on_conflict_do_update(
            index_elements=["sweep_id", "trial_key"], set_=update
        ).returning(t.c.id)
        with self._write() as conn:
            try:
                trial_id = int(conn.execute(stmt).scalar_one())
            except Exception as e:
                if "foreign key" in str(e).lower():
                    raise QkgeomError(f"no sweep with id {sweep_id} in {self.safe_url}") from None
                raise
            if reset:
                for model in (ProbeMetric, Probe, TrainStep, Checkpoint):
                    tab = model.__table__
                    conn.execute(tab.delete().where(tab.c.trial_id == trial_id))
        return trial_id

    def set_trial_status(self, trial_id: int, status: str, *, error: str | None = None,
                         host: str | None = None, device: str | None = None,
                         bump_attempts: bool = False) -> None:
        """Move a trial to ``status``.

        ``running`` sets started_at (the first time only) and heartbeat_at, and clears
        ended_at; a terminal
        status (error, interrupted, terminated) sets ended_at. ``error``, ``host`` and
        ``device`` are written when given (an earlier error text is kept otherwise).
        """
        from sqlalchemy import func

        check_status(status)
        t = Trial.__table__
        now = now_utc()
        values: dict[str, Any] = {"status": status}
        if status == "running":
            values["started_at"] = func.coalesce(t.c.started_at, now)
            values["heartbeat_at"] = now
            values["ended_at"] = None
        elif status in TERMINAL:
            values["ended_at"] = now
        if error is not None:
            values["error"] = error
        if host is not None:
            values["host"] = host
        if device is not None:
            values["device"] = device
        if bump_attempts:
            values["attempts"] = t.c.attempts + 1
        with self._write() as conn:
            n = conn.execute(t.update().where(t.c.id == trial_id).values(**values)).rowcount
        if n == 0:
            raise QkgeomError(f"no trial with id {trial_id} in {self.safe_url}")

    def record_attempt(self, trial_id: int, provenance: dict[str, Any], *,
                       attempt: int | None = None) -> int:
        """Record what runs attempt ``attempt`` of a trial (default: its latest, the
        ``attempts`` count) in ``trial_attempts``; returns the attempt number.

        The first call for an attempt sets ``started_at``; later calls overwrite only the
        fields ``provenance`` gives (``code_version``, ``git_commit``, ``git_dirty``,
        ``python``, ``torch``, ``ray``, ``cuda``, ``host``, ``device``, ``details``; see
        :func:`qkgeom.sweeps.provenance.provenance`). Unknown keys are refused.
        """
        from sqlalchemy import select

        t = Trial.__table__
        fields = _provenance_fields(provenance)
        with self._write() as conn:
            if attempt is None:
                attempt = conn.execute(select(t.c.attempts).where(t.c.id == trial_id)).scalar()
                if attempt is None:
                    raise QkgeomError(f"no trial with id {trial_id} in {self.safe_url}")
            self._upsert_attempt(conn, trial_id, int(attempt), fields)
        return int(attempt)

    def _upsert_attempt(self, conn: Any, trial_id: int, attempt: int,
                        fields: dict[str, Any]) -> None:
        """The ``trial_attempts`` row of ``attempt``: created with ``started_at`` now, or
        its given provenance ``fields`` overwritten."""
        a = TrialAttempt.__table__
        ins = self._insert(a).values(trial_id=trial_id, attempt=attempt, started_at=now_utc(),
                                     **fields)
        conn.execute(ins.on_conflict_do_update(index_elements=["trial_id", "attempt"],
                                               set_={k: ins.excluded[k] for k in fields})
                     if fields else ins.on_conflict_do_nothing())

    def start_attempt(self, trial_id: int, provenance: dict[str, Any] | None = None, *,
                      restored_step: int | None = None) -> tuple[int, dict[str, int]]:
        """A new attempt of a trial, in one transaction: ``running`` with one more attempt,
        its ``trial_attempts`` row (``provenance``, as :meth:`record_attempt`), and every
        row an earlier attempt wrote at steps after ``restored_step`` deleted (probes,
        metric values, training steps, checkpoint rows; every one of them when None: the
        attempt starts from scratch). The new attempt then writes its own, so what is
        stored is what an uninterrupted run stores, even where the earlier attempt got
        further than the checkpoint this one restores. Returns ``(attempt, rows deleted
        per table)``."""
        from sqlalchemy import func, select

        t = Trial.__table__
        fields = _provenance_fields(provenance or {})
        now = now_utc()
        with self._write() as conn:
            n = conn.execute(t.update().where(t.c.id == trial_id).values(
                status="running", started_at=func.coalesce(t.c.started_at, now),
                heartbeat_at=now, ended_at=None, attempts=t.c.attempts + 1)).rowcount
            if n == 0:
                raise QkgeomError(f"no trial with id {trial_id} in {self.safe_url}")
            attempt = int(conn.execute(select(t.c.attempts).where(t.c.id == trial_id))
                          .scalar_one())
            self._upsert_attempt(conn, trial_id, attempt, fields)
            cleared = self.clear_after(trial_id, restored_step, conn=conn)
        return attempt, cleared

    def clear_after(self, trial_id: int, step: int | None, *, conn: Any = None
                    ) -> dict[str, int]:
        """Delete what a trial stored at steps after ``step`` (all of it when None):
        probes, metric values, training steps, checkpoint rows. Returns the rows deleted
        per table. ``conn``: inside that open write transaction."""
        if conn is None:
            with self._write() as c:
                return self.clear_after(trial_id, step, conn=c)
        cleared = {}
        for model in (ProbeMetric, Probe, TrainStep, Checkpoint):
            tab = model.__table__
            q = tab.delete().where(tab.c.trial_id == trial_id)
            if step is not None:
                q = q.where(tab.c.step > int(step))
            cleared[tab.name] = int(conn.execute(q).rowcount or 0)
        return cleared

    def heartbeat(self, sweep_id: int, trial_id: int | None = None) -> int:
        """A sign of life: ``heartbeat_at`` = now for the sweep's ``running`` trials (only
        ``trial_id``, when given). Returns how many rows it touched."""
        t = Trial.__table__
        stmt = t.update().where(t.c.sweep_id == sweep_id, t.c.status == "running")
        if trial_id is not None:
            stmt = stmt.where(t.c.id == trial_id)
        with self._write() as conn:
            return int(conn.execute(stmt.values(heartbeat_at=now_utc())).rowcount or 0)

    def set_baseline_ref(self, trial_id: int, ref: dict | None) -> None:
        """Record which baseline an arm's target came from (``trials.baseline_ref``,
        :mod:`qkgeom.plan.pairing`); None clears it."""
        t = Trial.__table__
        with self._write() as conn:
            n = conn.execute(t.update().where(t.c.id == trial_id)
                             .values(baseline_ref=ref)).rowcount
        if n == 0:
            raise QkgeomError(f"no trial with id {trial_id} in {self.safe_url}")

    def set_trial_result(self, trial_id: int, *, test_loss: float) -> None:
        """Store a finished trial's final test loss (nats/char; NaN is stored as NULL)."""
        t = Trial.__table__
        with self._write() as conn:
            n = conn.execute(t.update().where(t.c.id == trial_id)
                             .values(test_loss=stored_float(test_loss))).rowcount
        if n == 0:
            raise QkgeomError(f"no trial with id {trial_id} in {self.safe_url}")

    def mark_running_interrupted(self, sweep_id: int) -> int:
        """Trials of the sweep left ``running`` (by a driver that died) -> ``interrupted``."""
        t = Trial.__table__
        stmt = (t.update().where(t.c.sweep_id == sweep_id, t.c.status == "running")
                .values(status="interrupted", ended_at=now_utc()))
        with self._write() as conn:
            return int(conn.execute(stmt).rowcount)

    def lock_sweep(self, conn: Any, name: str) -> None:
        """Inside a write transaction: hold sweep ``name``'s row until it ends, so no
        driver takes its lease meanwhile (PostgreSQL ``FOR UPDATE``; a SQLite write
        transaction already holds the whole database)."""
        from sqlalchemy import select

        s = Sweep.__table__
        q = select(s.c.id).where(s.c.name == name)
        if self.dialect == "postgresql":
            q = q.with_for_update()
        conn.execute(q).first()

    def delete_sweep(self, name: str, *, conn: Any = None) -> dict[str, int]:
        """Delete sweep ``name`` and every row of its trials, in one transaction (files are
        :func:`qkgeom.sweeps.files.remove_sweep`'s; ``conn``: inside that open write
        transaction). Returns the rows deleted per table, as :meth:`sweep_row_counts`
        counts them."""
        if conn is None:
            with self._write() as c:
                return self.delete_sweep(name, conn=c)
        from sqlalchemy import bindparam, select

        from qkgeom.store.models import TRIAL_TABLES, SweepLease

        s, t, lease = Sweep.__table__, Trial.__table__, SweepLease.__table__
        sid = conn.execute(select(s.c.id).where(s.c.name == name)).scalar()
        if sid is None:
            self.require_sweep(name)  # the error that lists the sweeps there
        ids = select(t.c.id).where(t.c.sweep_id == bindparam("sid")).scalar_subquery()
        out: dict[str, int] = {}
        for tab in TRIAL_TABLES:  # explicitly, not by cascade: counted, on any backend
            out[tab.name] = int(conn.execute(tab.delete().where(tab.c.trial_id.in_(ids)),
                                             {"sid": sid}).rowcount or 0)
        out["trials"] = int(conn.execute(t.delete().where(t.c.sweep_id == sid)).rowcount)
        conn.execute(lease.delete().where(lease.c.sweep_id == sid))
        conn.execute(s.delete().where(s.c.id == sid))
        return {"trials": out.pop("trials"), **out}


def _provenance_fields(provenance: dict[str, Any]) -> dict[str, Any]:
    """The provenance columns of a ``trial_attempts`` row; unknown keys are refused."""
    allowed = {c.name for c in TrialAttempt.__table__.columns} - {"trial_id", "attempt",
                                                                  "started_at"}
    unknown = set(provenance) - allowed
    if unknown:
        raise QkgeomError(f"unknown provenance field(s) {', '.join(sorted(unknown))}")
    return dict(provenance)
