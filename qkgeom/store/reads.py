"""Reads of the :class:`~qkgeom.store.Store`: free SQL, sweeps, trials, probe records
and parquet export. Results are polars DataFrames or plain dataclasses, never ORM rows."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from qkgeom.atomic import atomic_path
from qkgeom.errors import QkgeomError
from qkgeom.records import ProbeRecord, StepRecord
from qkgeom.store.base import StoreBase, loaded_float
from qkgeom.store.frames import (
    polars_type,
    result_frame,
    rows_frame,
    run_query,
    view_column_type,
)
from qkgeom.store.models import (
    Checkpoint,
    PretrainedRun,
    Probe,
    ProbeMetric,
    Sweep,
    TrainStep,
    Trial,
    TrialAttempt,
)


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
    baseline_ref: dict | None = None  # arms filled from a baseline (qkgeom.plan.pairing)
    heartbeat_at: datetime | None = None  # last sign of life while running (qkgeom.store.lifecycle)
    cell: str | None = None  # the spec's factor cell (qkgeom.plan.cells); None for a plain grid


class Reads(StoreBase):
    """Reads of results (part of :class:`~qkgeom.store.Store`)."""

    def sql(self, query: str | Any, params: dict | None = None) -> Any:
        """Run one query and return a polars DataFrame.

        Without ``params`` the SQL goes to the database verbatim (``%`` and ``:x`` mean
        nothing special); with ``params`` it is a SQLAlchemy ``text()`` with ``:name``
        bind parameters. ``query`` may also be a SQLAlchemy statement, e.g. a ``text()``
        with expanding bind parameters for IN lists (:mod:`qkgeom.store.queries`). Float
        NULLs are NaNs (see docs/schema.md); they stay null here.
        """
        with self._read() as conn:
            result = run_query(conn, query, params)
            if not result.returns_rows:
                raise QkgeomError("the statement returned no rows; statements that modify "
                                  "the database need --write (Store.execute in Python)")
            return result_frame(result)

    def execute(self, query: str, params: dict | None = None) -> tuple[Any, int]:
        """Run one statement in a write transaction and commit it.

        Returns ``(DataFrame, rowcount)`` for a statement that returns rows, else
        ``(None, rowcount)``. On a store opened read-only, writes are refused.
        """
        with self._write() as conn:
            result = run_query(conn, query, params)
            if result.returns_rows:
                return result_frame(result), result.rowcount
            return None, result.rowcount

    def sweeps(self) -> Any:
        """Every sweep: id, name, code_version, created_at, spec (JSON text), n_trials,
        heartbeat_s (seconds between its running trials' heartbeats, null for none)."""
        import polars as pl
        from sqlalchemy import func, select

        s, t = Sweep.__table__, Trial.__table__
        n = (select(func.count()).select_from(t).where(t.c.sweep_id == s.c.id)
             .scalar_subquery())
        q = select(s.c.id, s.c.name, s.c.code_version, s.c.created_at, s.c.spec,
                   n.label("n_trials"), s.c.heartbeat_s).order_by(s.c.id)
        with self._read() as conn:
            rows = conn.execute(q).all()
        return pl.DataFrame(
            [dict(id=r.id, name=r.name, code_version=r.code_version, created_at=r.created_at,
                  spec=json.dumps(r.spec, sort_keys=True), n_trials=r.n_trials,
                  heartbeat_s=r.heartbeat_s) for r in rows],
            schema={"id": pl.Int64, "name": pl.String, "code_version": pl.String,
                    "created_at": pl.Datetime("us"), "spec": pl.String, "n_trials": pl.Int64,
                    "heartbeat_s": pl.Float64},
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

    def sweep_names(self) -> list[str]:
        """Names of every sweep, sorted."""
        from sqlalchemy import select

        s = Sweep.__table__
        with self._read() as conn:
            return list(conn.execute(select(s.c.name).order_by(s.c.name)).scalars())

    def require_sweep(self, name: str) -> int:
        """The id of sweep ``name``; a QkgeomError listing the existing sweeps otherwise."""
        sid = self.sweep_id(name)
        if sid is None:
            names = self.sweep_names()
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
            ref = r.get("baseline_ref")
            r["baseline_ref"] = None if ref is None else json.dumps(ref, sort_keys=True)
        schema = {
            "sweep": pl.String, "id": pl.Int64, "sweep_id": pl.Int64, "trial_key": pl.String,
            "config": pl.String, "depth": pl.Int64, "init": pl.String, "arm": pl.String,
            "seed": pl.Int64, "status": pl.String, "attempts": pl.Int64, "error": pl.String,
            "created_at": pl.Datetime("us"), "started_at": pl.Datetime("us"),
            "ended_at": pl.Datetime("us"), "host": pl.String, "device": pl.String,
            "test_loss": pl.Float64, "baseline_ref": pl.String,
            "heartbeat_at": pl.Datetime("us"), "cell": pl.String,
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
                step=r.step, progress=loaded_float(r.progress), tokens=int(r.tokens),
                train_loss=loaded_float(r.train_loss), val_loss=loaded_float(r.val_loss),
                lr=loaded_float(r.lr),
                tokens_per_s=loaded_float(r.tokens_per_s),
            )
            for r in prows
        }
        for r in mrows:
            if r.step in recs:
                recs[r.step].metrics.append((r.layer, r.head, r.metric, loaded_float(r.value)))
        order = sorted(recs)
        for r in srows:
            i = bisect.bisect_left(order, r.step)
            if i < len(order):
                recs[order[i]].history.append(StepRecord(
                    step=r.step, train_loss=loaded_float(r.train_loss),
                    val_loss=loaded_float(r.val_loss),
                    lr=loaded_float(r.lr), tokens_per_s=loaded_float(r.tokens_per_s)))
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
            schema = {c.name: polars_type(c.type) for c in table.columns}
        else:
            # a view name from the fixed VIEWS list (identifiers cannot be bound)
            q, schema = text(f"SELECT * FROM {name}"), None
        writer = None
        rows = 0
        with atomic_path(path) as tmp, self._read() as conn:
            result = conn.execute(q, execution_options={"stream_results": True,
                                                         "yield_per": batch_size})
            if schema is None:
                schema = {k: view_column_type(k) for k in result.keys()}
            try:
                for part in result.partitions(batch_size):
                    tbl = rows_frame(part, schema).to_arrow()
                    rows += tbl.num_rows
                    if writer is None:
                        writer = pq.ParquetWriter(tmp, tbl.schema)
                    writer.write_table(tbl)
                if writer is None:
                    pl.DataFrame(schema=schema).write_parquet(tmp)
            finally:
                if writer is not None:
                    writer.close()
        return ExportedFile(name=name, path=path, rows=rows)

    # ------------------------------------------------------------------ sweep-side reads
    def last_probes(self, sweep_id: int) -> dict[int, tuple[int, float | None]]:
        """trial id -> ``(step, val_loss)`` of its last probe, for the trials of a sweep
        that have one (val_loss None when stored as NULL)."""
        from sqlalchemy import bindparam, func, select

        p, t = Probe.__table__, Trial.__table__
        last = (select(p.c.trial_id, func.max(p.c.step).label("step"))
                .join(t, t.c.id == p.c.trial_id)
                .where(t.c.sweep_id == bindparam("sweep_id"))
                .group_by(p.c.trial_id).subquery())
        q = select(p.c.trial_id, p.c.step, p.c.val_loss).join(
            last, (last.c.trial_id == p.c.trial_id) & (last.c.step == p.c.step))
        with self._read() as conn:
            rows = conn.execute(q, {"sweep_id": int(sweep_id)}).all()
        return {int(tid): (int(step), val) for tid, step, val in rows}

    def snapshot_counts(self, sweep_id: int) -> dict[int, int]:
        """trial id -> how many weight snapshots (``checkpoints`` of kind ``snapshot``) the
        database records for it, for the trials of a sweep that have any."""
        from sqlalchemy import bindparam, func, select

        c, t = Checkpoint.__table__, Trial.__table__
        q = (select(c.c.trial_id, func.count().label("n"))
             .join(t, t.c.id == c.c.trial_id)
             .where(t.c.sweep_id == bindparam("sweep_id"), c.c.kind == bindparam("kind"))
             .group_by(c.c.trial_id))
        with self._read() as conn:
            rows = conn.execute(q, {"sweep_id": int(sweep_id), "kind": "snapshot"}).all()
        return {int(tid): int(n) for tid, n in rows}


    # ------------------------------------------------------------------ checkpoint and pretrained reads
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

    def checkpoint_locations(self) -> list[tuple[str, str]]:
        """``(sweep name, location)`` of every ``checkpoints`` row of every sweep."""
        from sqlalchemy import select

        c, t, s = Checkpoint.__table__, Trial.__table__, Sweep.__table__
        q = (select(s.c.name, c.c.location).join(t, t.c.id == c.c.trial_id)
             .join(s, s.c.id == t.c.sweep_id).order_by(s.c.name, c.c.location))
        with self._read() as conn:
            return [(str(n), str(loc)) for n, loc in conn.execute(q)]

    def sweep_row_counts(self, name: str, *, conn: Any = None) -> dict[str, int]:
        """How many rows sweep ``name`` has in ``trials`` and in each table of trial rows
        (probes, probe_metrics, ...): what deleting it removes. ``conn``: read inside that
        open transaction."""
        if conn is None:
            with self._read() as c:
                return self.sweep_row_counts(name, conn=c)
        from sqlalchemy import bindparam, func, select

        from qkgeom.store.models import TRIAL_TABLES

        t, s = Trial.__table__, Sweep.__table__
        sid = conn.execute(select(s.c.id).where(s.c.name == name)).scalar()
        if sid is None:
            self.require_sweep(name)
        ids = select(t.c.id).where(t.c.sweep_id == bindparam("sid")).scalar_subquery()
        out = {"trials": int(conn.execute(select(func.count()).select_from(t).where(
            t.c.sweep_id == bindparam("sid")), {"sid": sid}).scalar_one())}
        for tab in TRIAL_TABLES:
            q = select(func.count()).select_from(tab).where(tab.c.trial_id.in_(ids))
            out[tab.name] = int(conn.execute(q, {"sid": sid}).scalar_one())
        return out

    def attempts(self, sweep: str) -> Any:
        """Every recorded attempt of sweep ``sweep``'s trials, ordered by trial and attempt:
        trial_key, trial_id, attempt, started_at and the provenance columns of
        ``trial_attempts`` (``details`` as JSON text)."""
        import polars as pl
        from sqlalchemy import select

        from qkgeom.store.frames import polars_type

        a, t = TrialAttempt.__table__, Trial.__table__
        q = (select(t.c.trial_key, a).join(t, t.c.id == a.c.trial_id)
             .where(t.c.sweep_id == self.require_sweep(sweep)).order_by(a.c.trial_id,
                                                                        a.c.attempt))
        with self._read() as conn:
            rows = [r._asdict() for r in conn.execute(q)]
        for r in rows:
            r["details"] = None if r["details"] is None else json.dumps(r["details"],
                                                                        sort_keys=True)
        schema = {"trial_key": pl.String, **{c.name: polars_type(c.type) for c in a.columns}}
        return pl.DataFrame(rows, schema=schema, orient="row" if rows else None)

    def pretrained_revisions(self, model: str) -> set[str]:
        """Revisions of pretrained model ``model`` already stored (``pretrained_runs``)."""
        from sqlalchemy import select

        p = PretrainedRun.__table__
        with self._read() as conn:
            return set(conn.execute(select(p.c.revision).where(p.c.model == model)).scalars())


