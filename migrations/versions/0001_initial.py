"""Initial tables: sweeps, trials, probes, probe_metrics, train_steps, checkpoints,
metric_definitions, pretrained_runs, pretrained_metrics.

Revision ID: 0001_initial
Revises:
Create Date: 2025-12-02

Frozen: this file must not import qkgeom's models (they move on; this revision does not).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001_initial"
down_revision = None
branch_labels = None
depends_on = None

JSONType = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
Double = sa.Float(precision=53).with_variant(postgresql.DOUBLE_PRECISION(), "postgresql")
Stamp = sa.DateTime(timezone=True)


def _fk_trial() -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(["trial_id"], ["trials.id"], ondelete="CASCADE")


def upgrade() -> None:
    op.create_table(
        "sweeps",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("spec", JSONType, nullable=False),
        sa.Column("code_version", sa.String(200), nullable=False),
        sa.Column("created_at", Stamp, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_sweeps"),
        sa.UniqueConstraint("name", name="uq_sweeps_name"),
    )
    op.create_table(
        "trials",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("sweep_id", sa.Integer(), nullable=False),
        sa.Column("trial_key", sa.String(200), nullable=False),
        sa.Column("config", JSONType, nullable=False),
        sa.Column("depth", sa.Integer(), nullable=False),
        sa.Column("init", sa.String(50), nullable=False),
        sa.Column("arm", sa.String(50), nullable=False),
        sa.Column("seed", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", Stamp, nullable=False),
        sa.Column("started_at", Stamp, nullable=True),
        sa.Column("ended_at", Stamp, nullable=True),
        sa.Column("host", sa.String(200), nullable=True),
        sa.Column("device", sa.String(200), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_trials"),
        sa.ForeignKeyConstraint(
            ["sweep_id"], ["sweeps.id"], ondelete="CASCADE", name="fk_trials_sweep_id_sweeps"
        ),
        sa.UniqueConstraint("sweep_id", "trial_key", name="uq_trials_sweep_id_trial_key"),
        sa.CheckConstraint(
            "status IN ('pending', 'running', 'error', 'interrupted', 'terminated')",
            name="ck_trials_status",
        ),
    )
    op.create_index("ix_trials_status", "trials", ["status"])
    op.create_table(
        "probes",
        sa.Column("trial_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("progress", Double, nullable=True),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("train_loss", Double, nullable=True),
        sa.Column("val_loss", Double, nullable=True),
        sa.Column("lr", Double, nullable=True),
        sa.Column("tokens_per_s", Double, nullable=True),
        sa.PrimaryKeyConstraint("trial_id", "step", name="pk_probes"),
        sa.ForeignKeyConstraint(
            ["trial_id"], ["trials.id"], ondelete="CASCADE", name="fk_probes_trial_id_trials"
        ),
    )
    op.create_table(
        "probe_metrics",
        sa.Column("trial_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("layer", sa.Integer(), nullable=False),
        sa.Column("head_key", sa.Integer(), nullable=False),
        sa.Column("metric", sa.String(64), nullable=False),
        sa.Column("head", sa.Integer(), nullable=True),
        sa.Column("progress", Double, nullable=True),
        sa.Column("value", Double, nullable=True),
        sa.PrimaryKeyConstraint(
            "trial_id", "step", "layer", "head_key", "metric", name="pk_probe_metrics"
        ),
        sa.ForeignKeyConstraint(
            ["trial_id"], ["trials.id"], ondelete="CASCADE",
            name="fk_probe_metrics_trial_id_trials",
        ),
        sa.CheckConstraint("head_key = coalesce(head, -1)", name="ck_probe_metrics_head_key"),
        sqlite_with_rowid=False,
    )
    op.create_table(
        "train_steps",
        sa.Column("trial_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("train_loss", Double, nullable=True),
        sa.Column("val_loss", Double, nullable=True),
        sa.Column("lr", Double, nullable=True),
        sa.Column("tokens_per_s", Double, nullable=True),
        sa.PrimaryKeyConstraint("trial_id", "step", name="pk_train_steps"),
        sa.ForeignKeyConstraint(
            ["trial_id"], ["trials.id"], ondelete="CASCADE",
            name="fk_train_steps_trial_id_trials",
        ),
    )
    op.create_table(
        "checkpoints",
        sa.Column("trial_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("location", sa.Text(), nullable=False),
        sa.Column("created_at", Stamp, nullable=False),
        sa.PrimaryKeyConstraint("trial_id", "step", name="pk_checkpoints"),
        sa.ForeignKeyConstraint(
            ["trial_id"], ["trials.id"], ondelete="CASCADE",
            name="fk_checkpoints_trial_id_trials",
        ),
    )
    op.create_table(
        "metric_definitions",
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("unit", sa.String(32), nullable=False),
        sa.Column("per_head", sa.Boolean(), nullable=False),
        sa.Column("doc", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_metric_definitions"),
    )
    op.create_table(
        "pretrained_runs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(300), nullable=False),
        sa.Column("revision", sa.String(200), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=True),
        sa.Column("meta", JSONType, nullable=False),
        sa.Column("created_at", Stamp, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_pretrained_runs"),
        sa.UniqueConstraint("model", "revision", name="uq_pretrained_runs_model_revision"),
    )
    op.create_table(
        "pretrained_metrics",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("layer", sa.Integer(), nullable=False),
        sa.Column("head_key", sa.Integer(), nullable=False),
        sa.Column("metric", sa.String(64), nullable=False),
        sa.Column("head", sa.Integer(), nullable=True),
        sa.Column("value", Double, nullable=True),
        sa.PrimaryKeyConstraint(
            "run_id", "layer", "head_key", "metric", name="pk_pretrained_metrics"
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["pretrained_runs.id"], ondelete="CASCADE",
            name="fk_pretrained_metrics_run_id_pretrained_runs",
        ),
        sa.CheckConstraint(
            "head_key = coalesce(head, -1)", name="ck_pretrained_metrics_head_key"
        ),
        sqlite_with_rowid=False,
    )


def downgrade() -> None:
    for table in ("pretrained_metrics", "pretrained_runs", "metric_definitions", "checkpoints",
                  "train_steps", "probe_metrics", "probes"):
        op.drop_table(table)
    op.drop_index("ix_trials_status", table_name="trials")
    op.drop_table("trials")
    op.drop_table("sweeps")
