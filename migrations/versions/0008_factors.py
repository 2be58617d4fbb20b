"""trials.cell and the view v_factors: a trial's factor values as columns.

Revision ID: 0008_factors
Revises: 0007_trial_attempts
Create Date: 2026-12-05

A spec with ``axes`` or ``cells`` (qkgeom.plan.cells) runs its grid and arms once per
cell; ``trials.cell`` is the cell's label (NULL for a sweep without factors, and in rows
written before this revision). ``v_factors`` has one row per trial with its sweep name,
cell, grid coordinates, status and test loss, and the TrialConfig keys that studies vary
as typed columns read from ``trials.config``, so ``GROUP BY n_embd, lr`` works on SQLite
and PostgreSQL alike. Frozen: this file must not import qkgeom's models; a config key
added later needs a new revision to appear as a column.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008_factors"
down_revision = "0007_trial_attempts"
branch_labels = None
depends_on = None

# the columns of v_factors read from trials.config, with their SQL types
FACTORS = {
    "n_embd": "integer", "n_head": "integer", "block_size": "integer",
    "batch_size": "integer", "max_steps": "integer", "warmup_steps": "integer",
    "probe_every": "integer",
    "lr": "real", "min_lr": "real", "warmup_frac": "real", "weight_decay": "real",
    "dropout": "real", "init_std": "real", "shrink_to": "real", "grad_clip": "real",
    "beta1": "real", "beta2": "real",
    "site": "text", "target_mode": "text", "shrink_schedule": "text", "dataset": "text",
}


def _column(dialect: str, key: str, kind: str) -> str:
    if dialect == "postgresql":
        cast = {"integer": "integer", "real": "double precision", "text": "text"}[kind]
        return f"CAST(t.config ->> '{key}' AS {cast}) AS {key}"
    if kind == "text":
        return f"json_extract(t.config, '$.{key}') AS {key}"
    return f"CAST(json_extract(t.config, '$.{key}') AS {kind.upper()}) AS {key}"


def view_sql(dialect: str) -> str:
    cols = ",\n  ".join(_column(dialect, k, kind) for k, kind in FACTORS.items())
    return (
        "SELECT t.id AS trial_id, t.sweep_id, s.name AS sweep, t.trial_key, t.cell,\n"
        "  t.depth, t.init, t.arm, t.seed, t.status, t.test_loss,\n  " + cols + "\n"
        "FROM trials t JOIN sweeps s ON s.id = t.sweep_id"
    )


def upgrade() -> None:
    # plain ALTER TABLE on both backends (a batch copy of trials would trip over the views)
    op.add_column("trials", sa.Column("cell", sa.String(200), nullable=True))
    op.execute(f"CREATE VIEW v_factors AS {view_sql(op.get_bind().dialect.name)}")


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS v_factors")
    op.drop_column("trials", "cell")  # SQLite >= 3.35; no other view names the column
