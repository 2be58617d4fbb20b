"""trial_attempts: the provenance of every attempt of every trial.

Revision ID: 0007_trial_attempts
Revises: 0006_heartbeat
Create Date: 2026-12-05

One row per start of a trial (``trials.attempts`` counts them): when it started, the code
that ran it (qkgeom's ``__version__+h<content hash>``, the git commit and whether the
checkout had uncommitted changes), the Python, torch, Ray and CUDA versions, the host and
the device, measured in the process that trained (qkgeom.provenance), and further details
as JSON. Databases written before this revision have no rows for their attempts.
Frozen: this file must not import qkgeom's models.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0007_trial_attempts"
down_revision = "0006_heartbeat"
branch_labels = None
depends_on = None

JSONType = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "trial_attempts",
        sa.Column("trial_id", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("code_version", sa.String(200), nullable=True),
        sa.Column("git_commit", sa.String(64), nullable=True),
        sa.Column("git_dirty", sa.Boolean(), nullable=True),
        sa.Column("python", sa.String(50), nullable=True),
        sa.Column("torch", sa.String(100), nullable=True),
        sa.Column("ray", sa.String(50), nullable=True),
        sa.Column("cuda", sa.String(50), nullable=True),
        sa.Column("host", sa.String(200), nullable=True),
        sa.Column("device", sa.String(200), nullable=True),
        sa.Column("details", JSONType, nullable=True),
        sa.ForeignKeyConstraint(["trial_id"], ["trials.id"], ondelete="CASCADE",
                                name="fk_trial_attempts_trial_id_trials"),
        sa.PrimaryKeyConstraint("trial_id", "attempt", name="pk_trial_attempts"),
    )


def downgrade() -> None:
    op.drop_table("trial_attempts")
