"""The :class:`Store`: every read and write of results goes through here.

Writes are one transaction per call, batched (``executemany``), and idempotent on natural
keys through the dialect's ``INSERT ... ON CONFLICT DO UPDATE``: writing a record again
(a retry, a resumed trial) leaves exactly one row with the latest values. Reads return
polars DataFrames or plain dataclasses, never ORM rows.
"""

from __future__ import annotations

import contextlib
import decimal
import json
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from qkgeom.errors import QkgeomError
from qkgeom.records import METRICS, ProbeRecord, StepRecord
from qkgeom.store.engine import (
    DatabaseError,
    connect_error,
    describe_db_error,
    make_engine,
    resolve_url,
    safe_url,
    sqlite_path,
)
from qkgeom.store.models import (
    CHECKPOINT_KINDS,
    STATUSES,
    TERMINAL,
    Checkpoint,
    MetricDefinition,
    PretrainedMetric,
    PretrainedRun,
    Probe,
    ProbeMetric,
    Sweep,
    TrainStep,
    Trial,
)
from qkgeom.store.schema import SchemaError, inspect_state, refusal, upgrade

# probe_metrics columns in the order of the tuples the write path builds
METRIC_COLUMNS = ("trial_id", "step", "layer", "head_key", "metric", "head", "progress", "value")


class ReadOnlyError(QkgeomError):
    """A statement tried to modify a database opened read-only."""


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _f(x: Any) -> float | None:
    """A float for storage: NaN -> NULL (SQLite cannot hold NaN); +-inf kept."""
    if x is None:
        return None
    x = float(x)
    return None if x != x else x


def _nan(x: float | None) -> float:
    return math.nan if x is None else float(x)


@dataclass(frozen=True)
class ExportedFile:
    name: str  # table or view
    path: Path
    rows: int


@dataclass(frozen=True)
class TrialInfo:
    """One row of ``trials`` as plain data."""

    id: int
    sweep_id: int
    trial_key: str
    config: dict
    depth: int
    init: str
    arm: str
    seed: int
    status: str
    attempts: int
    error: str | None
    created_at: datetime
    started_at: datetime | None
    ended_at: datetime | None
    host: str | None
    device: str | None
    test_loss: float | None = None  # nats/char at the end of training; None until then


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
    store = open_store(url, create=False, readonly=True)
    try:
        return store.sql(query, params)
    finally:
        store.close()


class Store:
    """An open results database. Not picklable (it holds an engine): pass the URL to
    other processes and call :func:`open_store` there. Close with :meth:`close`."""

    def __init__(self, engine: Any, url: str, *, revision: str, readonly: bool = False):
        self.engine = engine
        self.url = url  # with password: never print it; use safe_url
        self.safe_url = safe_url(url)
        self.revision = revision
        self.readonly = readonly
        self.dialect = engine.dialect.name
        self._stmts: dict[str, Any] = {}

    # ------------------------------------------------------------------ plumbing
    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({self.safe_url!r}, revision={self.revision!r})"

    def __reduce__(self) -> Any:
        raise TypeError(
            "a qkgeom Store holds a database engine and cannot be pickled; pass the URL "
            "and call qkgeom.store.open_store(url) where it is needed"
        )

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        from sqlalchemy.exc import SQLAlchemyError

        try:
            yield
        except SQLAlchemyError as e:
            msg = describe_db_error(e, self.url)
            if _is_readonly_error(msg):
                raise ReadOnlyError(
                    f"refused: {self.safe_url} is open read-only and the statement would "
                    f"modify it ({msg}); run it with --write to allow changes"
                ) from None
            raise DatabaseError(f"database error on {self.safe_url}: {msg}") from None

    @contextlib.contextmanager
    def _write(self) -> Iterator[Any]:
        """One write transaction (SQLite: BEGIN IMMEDIATE), committed on success."""
        with self._errors(), self.engine.connect() as conn:
            conn.execution_options(qkgeom_write=True)
            with conn.begin():
                yield conn

    @contextlib.contextmanager
    def _read(self) -> Iterator[Any]:
        with self._errors(), self.engine.connect() as conn:
            yield conn

    def _insert(self, table: Any) -> Any:
        if self.dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert
        else:
            from sqlalchemy.dialects.sqlite import insert
        return insert(table)

    def _upsert(self, model: Any, keys: Sequence[str], update: Sequence[str]) -> Any:
        """A cached ``INSERT ... ON CONFLICT (keys) DO UPDATE SET update = excluded``."""
        name = f"upsert:{model.__tablename__}"
        stmt = self._stmts.get(name)
        if stmt is None:
            ins = self._insert(model.__table__)
            stmt = ins.on_conflict_do_update(
                index_elements=list(keys), set_={c: ins.excluded[c] for c in update}
            )
            self._stmts[name] = stmt
        return stmt

    # ------------------------------------------------------------------ sweeps, trials
    def ensure_sweep(self, name: str, spec: dict, code_version: str) -> int:
        """The id of sweep ``name``, created if new; spec and code_version are updated."""
        ins = self._insert(Sweep.__table__).values(
            name=name, spec=spec, code_version=code_version, created_at=_now()
        )
        stmt = ins.on_conflict_do_update(
            index_elements=["name"],
            set_={"spec": ins.excluded.spec, "code_version": ins.excluded.code_version},
        ).returning(Sweep.__table__.c.id)
        with self._write() as conn:
            sweep_id = conn.execute(stmt).scalar_one()
            self._sync_metric_definitions(conn)
        return int(sweep_id)

    def _sync_metric_definitions(self, conn: Any) -> None:
        rows = [
            dict(name=k, unit=str(v.get("unit", "")), per_head=bool(v.get("per_head")),
                 doc=str(v.get("doc", "")))
            for k, v in METRICS.items()
        ]
        if rows:
            conn.execute(self._upsert(MetricDefinition, ["name"], ["unit", "per_head", "doc"]),
                         rows)

    def ensure_trial(self, sweep_id: int, trial_key: str, config: dict, *, depth: int,
                     init: str, arm: str, seed: int, status: str = "pending",
                     reset: bool = False) -> int:
        """The id of trial ``(sweep_id, trial_key)``, created with ``status`` if new.

        An existing trial gets the new config and promoted columns but keeps its status,
        attempts, error, times and results, unless ``reset=True``, which sets ``status``,
        clears attempts, error and times, and deletes its probes, metrics, training steps
        and checkpoints.
        """
        _check_status(status)
        t = Trial.__table__
        ins = self._insert(t).values(
            sweep_id=sweep_id, trial_key=trial_key, config=config, depth=int(depth),
            init=init, arm=arm, seed=int(seed), status=status, attempts=0, created_at=_now(),
        )
        update = {c: ins.excluded[c] for c in ("config", "depth", "init", "arm", "seed")}
        if reset:
            update.update(status=ins.excluded.status, attempts=0, error=None, started_at=None,
                          ended_at=None)
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

        ``running`` sets started_at (the first time only) and clears ended_at; a terminal
        status (error, interrupted, terminated) sets ended_at. ``error``, ``host`` and
        ``device`` are written when given (an earlier error text is kept otherwise).
        """
        from sqlalchemy import func

        _check_status(status)
        t = Trial.__table__
        now = _now()
        values: dict[str, Any] = {"status": status}
        if status == "running":
            values["started_at"] = func.coalesce(t.c.started_at, now)
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

    def set_trial_result(self, trial_id: int, *, test_loss: float) -> None:
        """Store a finished trial's final test loss (nats/char; NaN is stored as NULL)."""
        t = Trial.__table__
        with self._write() as conn:
            n = conn.execute(t.update().where(t.c.id == trial_id)
                             .values(test_loss=_f(test_loss))).rowcount
        if n == 0:
            raise QkgeomError(f"no trial with id {trial_id} in {self.safe_url}")

    def mark_running_interrupted(self, sweep_id: int) -> int:
        """Trials of the sweep left ``running`` (by a driver that died) -> ``interrupted``."""
        t = Trial.__table__
        stmt = (t.update().where(t.c.sweep_id == sweep_id, t.c.status == "running")
                .values(status="interrupted", ended_at=_now()))
        with self._write() as conn:
            return int(conn.execute(stmt).rowcount)

    # ------------------------------------------------------------------ results
    def write_probe(self, trial_id: int, record: ProbeRecord) -> None:
        """Write one probe: its scalars, metric rows and step history, in one transaction."""
        self.write_probes(trial_id, [record])

    def write_probes(self, trial_id: int, records: Iterable[ProbeRecord]) -> int:
        """Write many probes of one trial in one transaction; returns metric rows written."""
        probes: dict[int, dict] = {}
        metrics: dict[tuple, tuple] = {}
        steps: dict[int, dict] = {}
        for rec in records:
            step = int(rec.step)
            progress = _f(rec.progress)
            probes[step] = dict(
                trial_id=trial_id, step=step, progress=progress, tokens=int(rec.tokens),
                train_loss=_f(rec.train_loss), val_loss=_f(rec.val_loss), lr=_f(rec.lr),
                tokens_per_s=_f(rec.tokens_per_s),
            )
            for layer, head, name, value in rec.metrics:
                hk = -1 if head is None else int(head)
                v = float(value)
                # keyed on the natural key: a duplicate within one batch keeps the last
                metrics[(step, layer, hk, name)] = (
                    trial_id, step, int(layer), hk, name, None if head is None else hk,
                    progress, None if v != v else v,
                )
            for h in rec.history:
                steps[int(h.step)] = _step_row(trial_id, h)
        if not probes and not steps:
            return 0
        with self._write() as conn:
            if probes:
                conn.execute(
                    self._upsert(Probe, ["trial_id", "step"],
                                 ["progress", "tokens", "train_loss", "val_loss", "lr",
                                  "tokens_per_s"]),
                    list(probes.values()),
                )
            if metrics:
                self._upsert_metric_rows(conn, list(metrics.values()))
            if steps:
                conn.execute(
                    self._upsert(TrainStep, ["trial_id", "step"],
                                 ["train_loss", "val_loss", "lr", "tokens_per_s"]),
                    list(steps.values()),
                )
        return len(metrics)

    def _upsert_metric_rows(self, conn: Any, rows: list[tuple]) -> None:
        """The hot path: ``rows`` are tuples in :data:`METRIC_COLUMNS` order, unique keys.

        SQLite: the compiled upsert through the driver's executemany (SQLAlchemy's
        per-row parameter processing would halve the rate). PostgreSQL: COPY into a
        session-local staging table, then one ``INSERT ... SELECT ... ON CONFLICT``.
        """
        if self.dialect == "postgresql":
            self._pg_copy_upsert(conn, rows)
            return
        sql = self._stmts.get("metric_sql")
        if sql is None:
            stmt = self._upsert(ProbeMetric, METRIC_COLUMNS[:5], METRIC_COLUMNS[5:])
            compiled = stmt.compile(dialect=self.engine.dialect)
            assert list(compiled.positiontup or []) == list(METRIC_COLUMNS), compiled.positiontup
            sql = self._stmts["metric_sql"] = compiled.string
        conn.exec_driver_sql(sql, rows)

    def _pg_copy_upsert(self, conn: Any, rows: list[tuple]) -> None:
        cols = ", ".join(METRIC_COLUMNS)
        dbapi = conn.connection.dbapi_connection
        with dbapi.cursor() as cur:
            # every time (not cached): a rolled-back transaction also undoes its creation
            cur.execute(
                "CREATE TEMP TABLE IF NOT EXISTS qkgeom_stage_probe_metrics "
                "(LIKE probe_metrics INCLUDING DEFAULTS) ON COMMIT DELETE ROWS"
            )
            with cur.copy(f"COPY qkgeom_stage_probe_metrics ({cols}) FROM STDIN") as copy:
                for r in rows:
                    copy.write_row(r)
            keys = ", ".join(METRIC_COLUMNS[:5])
            upd = ", ".join(f"{c} = excluded.{c}" for c in METRIC_COLUMNS[5:])
            cur.execute(
                f"INSERT INTO probe_metrics ({cols}) SELECT {cols} FROM "
                f"qkgeom_stage_probe_metrics ON CONFLICT ({keys}) DO UPDATE SET {upd}"
            )
            cur.execute("DELETE FROM qkgeom_stage_probe_metrics")

    def write_steps(self, trial_id: int, history: Iterable[StepRecord]) -> None:
        """Write training scalars outside a probe (e.g. the tail after the last probe)."""
        rows = {int(h.step): _step_row(trial_id, h) for h in history}
        if rows:
            with self._write() as conn:
                conn.execute(
                    self._upsert(TrainStep, ["trial_id", "step"],
                                 ["train_loss", "val_loss", "lr", "tokens_per_s"]),
                    list(rows.values()),
                )

    def add_checkpoint(self, trial_id: int, step: int, location: str,
                       kind: str = "resume") -> None:
        """Record saved state of ``kind`` (resume | snapshot) at ``step`` (replaces one)."""
        _check_kind(kind)
        with self._write() as conn:
            conn.execute(
                self._upsert(Checkpoint, ["trial_id", "kind", "step"],
                             ["location", "created_at"]),
                [dict(trial_id=trial_id, kind=kind, step=int(step), location=str(location),
                      created_at=_now())],
            )

    def delete_checkpoint(self, trial_id: int, step: int, kind: str = "resume",
                          location: str | None = None) -> int:
        """Forget the ``kind`` row at ``step`` (only if it still names ``location``, when
        given: a newer save of the same step keeps its row). Returns rows deleted."""
        _check_kind(kind)
        c = Checkpoint.__table__
        stmt = c.delete().where(c.c.trial_id == trial_id, c.c.kind == kind,
                                c.c.step == int(step))
        if location is not None:
            stmt = stmt.where(c.c.location == str(location))
        with self._write() as conn:
            return int(conn.execute(stmt).rowcount or 0)

    def write_pretrained(self, model: str, revision: str, step: int | None, meta: dict,
                         rows: Sequence[tuple[int, int | None, str, float]]) -> int:
        """Store one pretrained model's measurement; returns its ``pretrained_runs`` id.

        Idempotent on (model, revision): writing again replaces the run's metadata and its
        metric rows with the new ones (exactly the new set of rows remains).
        """
        r = PretrainedRun.__table__
        ins = self._insert(r).values(model=model, revision=revision, step=step, meta=meta,
                                     created_at=_now())
        stmt = ins.on_conflict_do_update(
            index_elements=["model", "revision"],
            set_={c: ins.excluded[c] for c in ("step", "meta", "created_at")},
        ).returning(r.c.id)
        with self._write() as conn:
            run_id = int(conn.execute(stmt).scalar_one())
            pm = PretrainedMetric.__table__
            conn.execute(pm.delete().where(pm.c.run_id == run_id))
            out: dict[tuple, dict] = {}
            for layer, head, name, value in rows:
                hk = -1 if head is None else int(head)
                out[(int(layer), hk, name)] = dict(
                    run_id=run_id, layer=int(layer), head_key=hk, metric=name,
                    head=None if head is None else hk, value=_f(value),
                )
            if out:
                conn.execute(pm.insert(), list(out.values()))
        return run_id

    # ------------------------------------------------------------------ reads
    def sql(self, query: str, params: dict | None = None) -> Any:
        """Run one query and return a polars DataFrame.

        Without ``params`` the SQL goes to the database verbatim (``%`` and ``:x`` mean
        nothing special); with ``params`` it is a SQLAlchemy ``text()`` with ``:name``
        bind parameters. Float NULLs are NaNs (see docs/schema.md); they stay null here.
        """
        with self._read() as conn:
            result = _run(conn, query, params)
            if not result.returns_rows:
                raise QkgeomError("the statement returned no rows; statements that modify "
                                  "the database need --write (Store.execute in Python)")
            return _result_frame(result)

    def execute(self, query: str, params: dict | None = None) -> tuple[Any, int]:
        """Run one statement in a write transaction and commit it.

        Returns ``(DataFrame, rowcount)`` for a statement that returns rows, else
        ``(None, rowcount)``. On a store opened read-only, writes are refused.
        """
        with self._write() as conn:
            result = _run(conn, query, params)
            if result.returns_rows:
                return _result_frame(result), result.rowcount
            return None, result.rowcount

    def sweeps(self) -> Any:
        """Every sweep: id, name, code_version, created_at, spec (JSON text), n_trials."""
        import polars as pl
        from sqlalchemy import func, select

        s, t = Sweep.__table__, Trial.__table__
        n = (select(func.count()).select_from(t).where(t.c.sweep_id == s.c.id)
             .scalar_subquery())
        q = select(s.c.id, s.c.name, s.c.code_version, s.c.created_at, s.c.spec,
                   n.label("n_trials")).order_by(s.c.id)
        with self._read() as conn:
            rows = conn.execute(q).all()
        return pl.DataFrame(
            [dict(id=r.id, name=r.name, code_version=r.code_version, created_at=r.created_at,
                  spec=json.dumps(r.spec, sort_keys=True), n_trials=r.n_trials) for r in rows],
            schema={"id": pl.Int64, "name": pl.String, "code_version": pl.String,
                    "created_at": pl.Datetime("us"), "spec": pl.String, "n_trials": pl.Int64},
        )

    def sweep_id(self, name: str) -> int | None:
        from sqlalchemy import select

        s = Sweep.__table__
        with self._read() as conn:
            v = conn.execute(select(s.c.id).where(s.c.name == name)).scalar()
        return None if v is None else int(v)

    def sweep_spec(self, name: str) -> dict | None:
        """The stored spec of sweep ``name`` (as JSON data), or None if there is none."""
        from sqlalchemy import select

        s = Sweep.__table__
        with self._read() as conn:
            row = conn.execute(select(s.c.spec).where(s.c.name == name)).first()
        if row is None:
            return None
        return json.loads(row[0]) if isinstance(row[0], str) else row[0]

    def require_sweep(self, name: str) -> int:
        """The id of sweep ``name``; a QkgeomError listing the existing sweeps otherwise."""
        sid = self.sweep_id(name)
        if sid is None:
            from sqlalchemy import select

            s = Sweep.__table__
            with self._read() as conn:
                names = list(conn.execute(select(s.c.name).order_by(s.c.name)).scalars())
            have = ", ".join(names) if names else "none yet"
            raise QkgeomError(f"no sweep named {name!r} in {self.safe_url}; sweeps: {have}")
        return sid

    def trials(self, sweep: str | None = None) -> Any:
        """Trials (of one sweep, or all) with their sweep name; config as JSON text."""
        import polars as pl
        from sqlalchemy import select

        s, t = Sweep.__table__, Trial.__table__
        q = select(s.c.name.label("sweep"), t).join(s, s.c.id == t.c.sweep_id).order_by(t.c.id)
        if sweep is not None:
            q = q.where(t.c.sweep_id == self.require_sweep(sweep))
        with self._read() as conn:
            rows = [r._asdict() for r in conn.execute(q)]
        for r in rows:
            r["config"] = json.dumps(r["config"], sort_keys=True)
        schema = {
            "sweep": pl.String, "id": pl.Int64, "sweep_id": pl.Int64, "trial_key": pl.String,
            "config": pl.String, "depth": pl.Int64, "init": pl.String, "arm": pl.String,
            "seed": pl.Int64, "status": pl.String, "attempts": pl.Int64, "error": pl.String,
            "created_at": pl.Datetime("us"), "started_at": pl.Datetime("us"),
            "ended_at": pl.Datetime("us"), "host": pl.String, "device": pl.String,
            "test_loss": pl.Float64,
        }
        return pl.DataFrame(rows, schema=schema, orient="row" if not rows else None)

    def trial_id(self, sweep_id: int, trial_key: str) -> int | None:
        from sqlalchemy import select

        t = Trial.__table__
        with self._read() as conn:
            v = conn.execute(select(t.c.id).where(t.c.sweep_id == sweep_id,
                                                  t.c.trial_key == trial_key)).scalar()
        return None if v is None else int(v)

    def get_trial(self, trial_id: int) -> TrialInfo:
        from sqlalchemy import select

        t = Trial.__table__
        with self._read() as conn:
            r = conn.execute(select(t).where(t.c.id == trial_id)).first()
        if r is None:
            raise QkgeomError(f"no trial with id {trial_id} in {self.safe_url}")
        return TrialInfo(**r._asdict())

    def read_probes(self, trial_id: int) -> list[ProbeRecord]:
        """The probe records of a trial as written (NaN restored), ordered by step.

        A StepRecord belongs to the first probe at or after its step; steps after the last
        probe are not returned (read ``train_steps``).
        """
        import bisect

        from sqlalchemy import select

        p, m, ts = Probe.__table__, ProbeMetric.__table__, TrainStep.__table__
        with self._read() as conn:
            prows = conn.execute(select(p).where(p.c.trial_id == trial_id)
                                 .order_by(p.c.step)).all()
            mrows = conn.execute(
                select(m.c.step, m.c.layer, m.c.head, m.c.metric, m.c.value)
                .where(m.c.trial_id == trial_id)
                .order_by(m.c.step, m.c.layer, m.c.head_key, m.c.metric)).all()
            srows = conn.execute(select(ts).where(ts.c.trial_id == trial_id)
                                 .order_by(ts.c.step)).all()
        recs = {
            r.step: ProbeRecord(
                step=r.step, progress=_nan(r.progress), tokens=int(r.tokens),
                train_loss=_nan(r.train_loss), val_loss=_nan(r.val_loss), lr=_nan(r.lr),
                tokens_per_s=_nan(r.tokens_per_s),
            )
            for r in prows
        }
        for r in mrows:
            if r.step in recs:
                recs[r.step].metrics.append((r.layer, r.head, r.metric, _nan(r.value)))
        order = sorted(recs)
        for r in srows:
            i = bisect.bisect_left(order, r.step)
            if i < len(order):
                recs[order[i]].history.append(StepRecord(
                    step=r.step, train_loss=_nan(r.train_loss), val_loss=_nan(r.val_loss),
                    lr=_nan(r.lr), tokens_per_s=_nan(r.tokens_per_s)))
        return [recs[s] for s in order]

    # ------------------------------------------------------------------ export
    def export(self, out_dir: str | os.PathLike, *, views: bool = False,
               batch_size: int = 500_000) -> list[ExportedFile]:
        """Write every table (and with ``views`` every view) to ``out_dir/<name>.parquet``.

        JSON columns become JSON text; floats keep NULL for NaN (as stored).
        """
        from qkgeom.store.models import TABLES
        from qkgeom.store.models import VIEWS as VIEW_NAMES

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        names = list(TABLES) + (list(VIEW_NAMES) if views else [])
        return [self._export_one(name, out / f"{name}.parquet", batch_size) for name in names]

    def _export_one(self, name: str, path: Path, batch_size: int) -> ExportedFile:
        import polars as pl
        import pyarrow.parquet as pq
        from sqlalchemy import Text, cast, select, text
        from sqlalchemy import types as sat

        from qkgeom.store.models import Base

        table = Base.metadata.tables.get(name)
        if table is not None:
            q = select(*[cast(c, Text).label(c.name) if isinstance(c.type, sat.JSON) else c
                         for c in table.columns])
            schema = {c.name: _polars_type(c.type) for c in table.columns}
        else:
            q, schema = text(f"SELECT * FROM {name}"), None
        tmp = path.with_name(path.name + ".tmp")
        writer = None
        rows = 0
        with self._read() as conn:
            result = conn.execute(q, execution_options={"stream_results": True,
                                                         "yield_per": batch_size})
            if schema is None:
                schema = {k: _view_column_type(k) for k in result.keys()}
            try:
                for part in result.partitions(batch_size):
                    tbl = _frame(part, schema).to_arrow()
                    rows += tbl.num_rows
                    if writer is None:
                        writer = pq.ParquetWriter(tmp, tbl.schema)
                    writer.write_table(tbl)
                if writer is None:
                    pl.DataFrame(schema=schema).write_parquet(tmp)
            finally:
                if writer is not None:
                    writer.close()
        tmp.replace(path)
        return ExportedFile(name=name, path=path, rows=rows)

    # --- checkpoint / pretrained reads (moved from pretrained.py, issue 13)
    def trial_checkpoints(self, sweep: str, trial_key: str) -> list[tuple[int, str, str]]:
        """``(step, kind, location)`` of every checkpoint row of trial ``trial_key`` of sweep
        ``sweep``, ordered by step; empty when none are recorded (or no such trial)."""
        from sqlalchemy import select

        c, t, s = Checkpoint.__table__, Trial.__table__, Sweep.__table__
        q = (select(c.c.step, c.c.kind, c.c.location)
             .join(t, t.c.id == c.c.trial_id).join(s, s.c.id == t.c.sweep_id)
             .where(s.c.name == sweep, t.c.trial_key == trial_key).order_by(c.c.step))
        with self._read() as conn:
            return [(int(r.step), str(r.kind), str(r.location)) for r in conn.execute(q)]

    def pretrained_revisions(self, model: str) -> set[str]:
        """Revisions of pretrained model ``model`` already stored (``pretrained_runs``)."""
        from sqlalchemy import select

        p = PretrainedRun.__table__
        with self._read() as conn:
            return set(conn.execute(select(p.c.revision).where(p.c.model == model)).scalars())


def _run(conn: Any, query: str, params: dict | None) -> Any:
    if params is None:
        return conn.execution_options(no_parameters=True).exec_driver_sql(query)
    from sqlalchemy import text

    return conn.execute(text(query), params)


def _result_frame(result: Any) -> Any:
    """A polars DataFrame from a SQLAlchemy result (types inferred from all rows)."""
    import polars as pl

    keys = list(result.keys())
    rows = [tuple(r) for r in result]
    if len(set(keys)) != len(keys):
        raise QkgeomError(f"the query returns duplicate column names {keys}; alias them "
                          "(SELECT a.x AS a_x, b.x AS b_x ...)")
    if not rows:
        return pl.DataFrame(schema={k: pl.Null for k in keys})
    # PostgreSQL hands JSONB over as dicts and NUMERIC (e.g. AVG of integers) as Decimal;
    # SQLite as JSON text and floats. Make both look like SQLite's.
    fix = {}
    for i in range(len(keys)):
        first = next((r[i] for r in rows if r[i] is not None), None)
        if isinstance(first, (dict, list)):
            fix[i] = lambda v: None if v is None else json.dumps(v, sort_keys=True)
        elif isinstance(first, decimal.Decimal):
            fix[i] = lambda v: None if v is None else float(v)
    if fix:
        rows = [tuple(fix[i](v) if i in fix else v for i, v in enumerate(r)) for r in rows]
    return pl.DataFrame(rows, schema=keys, orient="row", infer_schema_length=None,
                        strict=False)


def _frame(rows: Sequence[Any], schema: dict) -> Any:
    import polars as pl

    return pl.DataFrame([tuple(r) for r in rows], schema=schema, orient="row")


def _polars_type(t: Any) -> Any:
    import polars as pl
    from sqlalchemy import types as sat

    if isinstance(t, sat.Boolean):
        return pl.Boolean
    if isinstance(t, sat.Integer):
        return pl.Int64
    if isinstance(t, (sat.Float, sat.Numeric)):
        return pl.Float64
    if isinstance(t, sat.DateTime):
        return pl.Datetime("us", "UTC")
    return pl.String


def _view_column_type(name: str) -> Any:
    """Column types of the views (reflection cannot type SQLite view expressions)."""
    import polars as pl

    if name in ("value", "progress", "test_loss"):
        return pl.Float64
    if name in ("sweep", "trial_key", "init", "arm", "status", "metric", "model", "revision"):
        return pl.String
    return pl.Int64


def _step_row(trial_id: int, h: StepRecord) -> dict:
    return dict(trial_id=trial_id, step=int(h.step), train_loss=_f(h.train_loss),
                val_loss=_f(h.val_loss), lr=_f(h.lr), tokens_per_s=_f(h.tokens_per_s))


def _check_status(status: str) -> None:
    if status not in STATUSES:
        raise QkgeomError(f"unknown trial status {status!r}; choose from {', '.join(STATUSES)}")


def _check_kind(kind: str) -> None:
    if kind not in CHECKPOINT_KINDS:
        raise QkgeomError(f"unknown checkpoint kind {kind!r}; choose from "
                          f"{', '.join(CHECKPOINT_KINDS)}")


def _is_readonly_error(msg: str) -> bool:
    low = msg.lower()
    return ("readonly database" in low or "read-only transaction" in low
            or "read only" in low and "transaction" in low)
