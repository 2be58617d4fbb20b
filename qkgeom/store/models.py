"""The results database: one declarative ``Base`` whose metadata alembic migrates.

Long rows, not wide columns: one ``probe_metrics`` row per (trial, step, layer, head,
metric). See docs/schema.md for every column's unit and the reasons.

Pitfalls this module settles once:

* ``head`` is NULL for a layer-level value, and SQL treats NULLs as distinct in a unique
  key, so the primary key uses ``head_key`` = ``coalesce(head, -1)`` (written by
  :mod:`qkgeom.store.store`, checked by a CHECK constraint).
* Non-finite floats: SQLite stores NaN as NULL. Every float column therefore means
  "NULL = NaN" on both backends (we write NaN as NULL on PostgreSQL too, so the same SQL
  gives the same answer everywhere); +inf and -inf are stored as IEEE infinities, which
  both backends keep. A metric row exists only when it was measured, so NULL is never
  "missing" in ``probe_metrics``.
* ``probe_metrics`` and ``pretrained_metrics`` are ``WITHOUT ROWID`` on SQLite: the
  primary key *is* the table, one b-tree per insert instead of two.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.dialects.postgresql import DOUBLE_PRECISION, JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# JSON text on SQLite, JSONB (indexable, ->> operators) on PostgreSQL
JSONType = JSON().with_variant(JSONB(), "postgresql")
# 64-bit floats on both backends (plain Float is REAL = 32-bit on PostgreSQL)
Double = Float(precision=53).with_variant(DOUBLE_PRECISION(), "postgresql")
Stamp = DateTime(timezone=True)

STATUSES = ("pending", "running", "error", "interrupted", "terminated")
# resume: Tune's full training state (pruned as training moves on); snapshot: the weights
# at a probe step (kept per the sweep's snapshot policy)
CHECKPOINT_KINDS = ("resume", "snapshot")
TERMINAL = ("error", "interrupted", "terminated")


# named primary and foreign keys, so alembic's batch mode on SQLite can find them later
NAMING = {
    "pk": "pk_%(table_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class Sweep(Base):
    """One study: a named grid of trials."""

    __tablename__ = "sweeps"
    __table_args__ = (UniqueConstraint("name", name="uq_sweeps_name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    spec: Mapped[dict] = mapped_column(JSONType)
    code_version: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(Stamp)
    # seconds between the heartbeats of the sweep's running trials, as its last run wrote
    # them; NULL when no heartbeat is promised (qkgeom train --db, older databases)
    heartbeat_s: Mapped[float | None] = mapped_column(Double)
    # database_info.identity of the database whose driver created the sweep and its files
    # (carried by qkgeom db merge); NULL for sweeps recorded before revision 0009
    origin: Mapped[str | None] = mapped_column(String(64))


class DatabaseInfo(Base):
    """Facts about the database itself: ``identity`` (random hex, stamped in the
    directories qkgeom creates for its sweeps) and ``created_at``."""

    __tablename__ = "database_info"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(Text)


class SweepLease(Base):
    """The one driver that holds a sweep (``qkgeom.store.lease``): who (host, pid,
    command, a random token), since when and its last heartbeat, both from the database's
    own clock; it is stale after ``stale_after_s`` seconds without a heartbeat."""

    __tablename__ = "sweep_leases"

    sweep_id: Mapped[int] = mapped_column(
        ForeignKey("sweeps.id", ondelete="CASCADE"), primary_key=True
    )
    token: Mapped[str] = mapped_column(String(64))
    host: Mapped[str] = mapped_column(String(200))
    pid: Mapped[int] = mapped_column(Integer)
    command: Mapped[str | None] = mapped_column(String(200))
    taken_at: Mapped[datetime] = mapped_column(Stamp)
    heartbeat_at: Mapped[datetime] = mapped_column(Stamp)
    stale_after_s: Mapped[float] = mapped_column(Double)


class Trial(Base):
    """One training run of one configuration."""

    __tablename__ = "trials"
    __table_args__ = (
        UniqueConstraint("sweep_id", "trial_key", name="uq_trials_sweep_id_trial_key"),
        CheckConstraint(
            "status IN ('pending', 'running', 'error', 'interrupted', 'terminated')",
            name="ck_trials_status",
        ),
        Index("ix_trials_status", "status"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    sweep_id: Mapped[int] = mapped_column(ForeignKey("sweeps.id", ondelete="CASCADE"))
    trial_key: Mapped[str] = mapped_column(String(200))
    config: Mapped[dict] = mapped_column(JSONType)
    depth: Mapped[int] = mapped_column(Integer)
    init: Mapped[str] = mapped_column(String(50))
    arm: Mapped[str] = mapped_column(String(50))
    seed: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(20))
    attempts: Mapped[int] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(Stamp)
    started_at: Mapped[datetime | None] = mapped_column(Stamp)
    ended_at: Mapped[datetime | None] = mapped_column(Stamp)
    host: Mapped[str | None] = mapped_column(String(200))
    device: Mapped[str | None] = mapped_column(String(200))
    # loss on the held-out evaluation split at the end of training (nats/char); NULL until
    # the trial finishes (or NaN)
    test_loss: Mapped[float | None] = mapped_column(Double)
    # arms with a baseline-relative target: the baseline they were filled from (trial key,
    # attempt, metric, digest of the target, Tune experiment); NULL otherwise
    # (qkgeom.plan.pairing)
    baseline_ref: Mapped[dict | None] = mapped_column(JSONType)
    # last sign of life of a running trial's driver (qkgeom.store.lifecycle judges staleness)
    heartbeat_at: Mapped[datetime | None] = mapped_column(Stamp)
    cell: Mapped[str | None] = mapped_column(String(200))  # qkgeom.plan.cells label


class TrialAttempt(Base):
    """One start of a trial, and what ran it: the code (content hash, git commit, dirty
    flag), the Python/torch/Ray/CUDA versions, host and device (``qkgeom.sweeps.provenance``,
    measured where the trial trained; NULL until known, e.g. before the first result)."""

    __tablename__ = "trial_attempts"

    trial_id: Mapped[int] = mapped_column(
        ForeignKey("trials.id", ondelete="CASCADE"), primary_key=True
    )
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)  # 1, 2, ... (trials.attempts)
    started_at: Mapped[datetime] = mapped_column(Stamp)
    code_version: Mapped[str | None] = mapped_column(String(200))
    git_commit: Mapped[str | None] = mapped_column(String(64))
    git_dirty: Mapped[bool | None] = mapped_column(Boolean)
    python: Mapped[str | None] = mapped_column(String(50))
    torch: Mapped[str | None] = mapped_column(String(100))
    ray: Mapped[str | None] = mapped_column(String(50))
    cuda: Mapped[str | None] = mapped_column(String(50))
    host: Mapped[str | None] = mapped_column(String(200))
    device: Mapped[str | None] = mapped_column(String(200))
    details: Mapped[dict | None] = mapped_column(JSONType)


class Probe(Base):
    """The training scalars at one probe step of one trial."""

    __tablename__ = "probes"

    trial_id: Mapped[int] = mapped_column(
        ForeignKey("trials.id", ondelete="CASCADE"), primary_key=True
    )
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    progress: Mapped[float | None] = mapped_column(Double)
    tokens: Mapped[int] = mapped_column(BigInteger)
    train_loss: Mapped[float | None] = mapped_column(Double)
    val_loss: Mapped[float | None] = mapped_column(Double)
    lr: Mapped[float | None] = mapped_column(Double)
    tokens_per_s: Mapped[float | None] = mapped_column(Double)


class ProbeMetric(Base):
    """One metric value: (trial, step, layer, head or NULL, metric) -> value."""

    __tablename__ = "probe_metrics"
    __table_args__ = (
        CheckConstraint("head_key = coalesce(head, -1)", name="ck_probe_metrics_head_key"),
        {"sqlite_with_rowid": False},
    )

    trial_id: Mapped[int] = mapped_column(
        ForeignKey("trials.id", ondelete="CASCADE"), primary_key=True
    )
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    layer: Mapped[int] = mapped_column(Integer, primary_key=True)
    head_key: Mapped[int] = mapped_column(Integer, primary_key=True)
    metric: Mapped[str] = mapped_column(String(64), primary_key=True)
    head: Mapped[int | None] = mapped_column(Integer)
    progress: Mapped[float | None] = mapped_column(Double)
    value: Mapped[float | None] = mapped_column(Double)


class TrainStep(Base):
    """Training scalars every ``log_every`` steps (the history between probes)."""

    __tablename__ = "train_steps"

    trial_id: Mapped[int] = mapped_column(
        ForeignKey("trials.id", ondelete="CASCADE"), primary_key=True
    )
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    train_loss: Mapped[float | None] = mapped_column(Double)
    val_loss: Mapped[float | None] = mapped_column(Double)
    lr: Mapped[float | None] = mapped_column(Double)
    tokens_per_s: Mapped[float | None] = mapped_column(Double)


class Checkpoint(Base):
    """Where a trial's saved state of one kind at one step lives (a path or URI).

    A row exists only while its location does: pruning a resume checkpoint deletes its row.
    """

    __tablename__ = "checkpoints"
    __table_args__ = (
        CheckConstraint("kind IN ('resume', 'snapshot')", name="ck_checkpoints_kind"),
    )

    trial_id: Mapped[int] = mapped_column(
        ForeignKey("trials.id", ondelete="CASCADE"), primary_key=True
    )
    kind: Mapped[str] = mapped_column(String(20), primary_key=True, server_default="resume")
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    location: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(Stamp)


class MetricDefinition(Base):
    """Unit and meaning of each metric name (``qkgeom.records.METRIC_DEFINITIONS``)."""

    __tablename__ = "metric_definitions"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    unit: Mapped[str] = mapped_column(String(32))
    per_head: Mapped[bool] = mapped_column(Boolean)
    doc: Mapped[str] = mapped_column(Text)


class PretrainedRun(Base):
    """One measurement of a pretrained model (natural key: model, revision)."""

    __tablename__ = "pretrained_runs"
    __table_args__ = (
        UniqueConstraint("model", "revision", name="uq_pretrained_runs_model_revision"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    model: Mapped[str] = mapped_column(String(300))
    revision: Mapped[str] = mapped_column(String(200))
    step: Mapped[int | None] = mapped_column(BigInteger)
    meta: Mapped[dict] = mapped_column(JSONType)
    created_at: Mapped[datetime] = mapped_column(Stamp)


class PretrainedMetric(Base):
    """One metric value of a pretrained model: (run, layer, head or NULL, metric)."""

    __tablename__ = "pretrained_metrics"
    __table_args__ = (
        CheckConstraint(
            "head_key = coalesce(head, -1)", name="ck_pretrained_metrics_head_key"
        ),
        {"sqlite_with_rowid": False},
    )

    run_id: Mapped[int] = mapped_column(
        ForeignKey("pretrained_runs.id", ondelete="CASCADE"), primary_key=True
    )
    layer: Mapped[int] = mapped_column(Integer, primary_key=True)
    head_key: Mapped[int] = mapped_column(Integer, primary_key=True)
    metric: Mapped[str] = mapped_column(String(64), primary_key=True)
    head: Mapped[int | None] = mapped_column(Integer)
    value: Mapped[float | None] = mapped_column(Double)


TABLES = [t.name for t in Base.metadata.sorted_tables]
# the tables whose rows belong to one trial (``trial_id``), in the order messages list
# them: deleting a sweep deletes them (tests check that every such table is here)
TRIAL_TABLES = [m.__table__ for m in (TrialAttempt, Probe, ProbeMetric, TrainStep, Checkpoint)]
VIEWS = [
    "v_metrics", "v_layer_metrics", "v_head_means", "v_trajectories", "v_final", "v_pretrained",
    "v_factors",
]
