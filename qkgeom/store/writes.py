"""Result writes of the :class:`~qkgeom.store.Store`: probes with their metric rows and
step history, training steps, checkpoints and pretrained measurements. One transaction
per call, batched, idempotent on natural keys."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from qkgeom.records import METRIC_DEFINITIONS, ProbeRecord, StepRecord
from qkgeom.store.base import StoreBase, check_kind, now_utc, stored_float
from qkgeom.store.models import (
    Checkpoint,
    MetricDefinition,
    PretrainedMetric,
    PretrainedRun,
    Probe,
    ProbeMetric,
    TrainStep,
)

# probe_metrics columns in the order of the tuples the write path builds
METRIC_COLUMNS = ("trial_id", "step", "layer", "head_key", "metric", "head", "progress", "value")


class ResultWrites(StoreBase):
    """Writes of results (part of :class:`~qkgeom.store.Store`)."""

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
            progress = stored_float(rec.progress)
            probes[step] = dict(
                trial_id=trial_id, step=step, progress=progress, tokens=int(rec.tokens),
                train_loss=stored_float(rec.train_loss), val_loss=stored_float(rec.val_loss),
                lr=stored_float(rec.lr),
                tokens_per_s=stored_float(rec.tokens_per_s),
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
                steps[int(h.step)] = step_row(trial_id, h)
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
        # the SQL below is built from the METRIC_COLUMNS names only; values go through COPY
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
        rows = {int(h.step): step_row(trial_id, h) for h in history}
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
        check_kind(kind)
        with self._write() as conn:
            conn.execute(
                self._upsert(Checkpoint, ["trial_id", "kind", "step"],
                             ["location", "created_at"]),
                [dict(trial_id=trial_id, kind=kind, step=int(step), location=str(location),
                      created_at=now_utc())],
            )

    def delete_checkpoint(self, trial_id: int, step: int, kind: str = "resume",
                          location: str | None = None) -> int:
        """Forget the ``kind`` row at ``step`` (only if it still names ``location``, when
        given: a newer save of the same step keeps its row). Returns rows deleted."""
        check_kind(kind)
        c = Checkpoint.__table__
        stmt = c.delete().where(c.c.trial_id == trial_id, c.c.kind == kind,
                                c.c.step == int(step))
        if location is not None:
            stmt = stmt.where(c.c.location == str(location))
        with self._write() as conn:
            return int(conn.execute(stmt).rowcount or 0)

    def _sync_metric_definitions(self, conn: Any) -> None:
        """Declare every metric name (unit, meaning) in ``metric_definitions``."""
        rows = [dict(name=k, unit=str(v.get("unit", "")), per_head=bool(v.get("per_head")),
                     doc=str(v.get("doc", ""))) for k, v in METRIC_DEFINITIONS.items()]
        conn.execute(self._upsert(MetricDefinition, ["name"], ["unit", "per_head", "doc"]),
                     rows)

    def write_pretrained(self, model: str, revision: str, step: int | None, meta: dict,
                         rows: Sequence[tuple[int, int | None, str, float]]) -> int:
        """Store one pretrained model's measurement; returns its ``pretrained_runs`` id.

        Idempotent on (model, revision): writing again replaces the run's metadata and its
        metric rows with the new ones (exactly the new set of rows remains).
        """
        r = PretrainedRun.__table__
        ins = self._insert(r).values(model=model, revision=revision, step=step, meta=meta,
                                     created_at=now_utc())
        stmt = ins.on_conflict_do_update(
            index_elements=["model", "revision"],
            set_={c: ins.excluded[c] for c in ("step", "meta", "created_at")},
        ).returning(r.c.id)
        with self._write() as conn:
            run_id = int(conn.execute(stmt).scalar_one())
            self._sync_metric_definitions(conn)  # a database of pretrained runs only, too
            pm = PretrainedMetric.__table__
            conn.execute(pm.delete().where(pm.c.run_id == run_id))
            out: dict[tuple, dict] = {}
            for layer, head, name, value in rows:
                hk = -1 if head is None else int(head)
                out[(int(layer), hk, name)] = dict(
                    run_id=run_id, layer=int(layer), head_key=hk, metric=name,
                    head=None if head is None else hk, value=stored_float(value),
                )
            if out:
                conn.execute(pm.insert(), list(out.values()))
        return run_id


def step_row(trial_id: int, h: StepRecord) -> dict:
    return dict(trial_id=trial_id, step=int(h.step), train_loss=stored_float(h.train_loss),
                val_loss=stored_float(h.val_loss), lr=stored_float(h.lr),
                tokens_per_s=stored_float(h.tokens_per_s))

