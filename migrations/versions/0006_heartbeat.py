"""trials.heartbeat_at and sweeps.heartbeat_s: running trials show whether their driver
is still alive.

Revision ID: 0006_heartbeat
Revises: 0005_baseline_ref
Create Date: 2026-12-05

While a sweep runs, its driver refreshes ``trials.heartbeat_at`` of its running trials on
every result and at least every ``sweeps.heartbeat_s`` seconds; a running trial whose
heartbeat is older than three intervals has lost its driver (qkgeom.lifecycle). Both
columns are NULL in rows written before this revision. Frozen: this file must not import
qkgeom's models.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0006_heartbeat"
down_revision = "0005_baseline_ref"
branch_labels = None
depends_on = None

Double = sa.Float(precision=53).with_variant(postgresql.DOUBLE_PRECISION(), "postgresql")


def upgrade() -> None:
    # plain ALTER TABLE on both backends (a batch copy of trials would trip over the views)
    op.add_column("trials", sa.Column("heartbeat_at", sa.DateTime(timezone=True),
                                      nullable=True))
    op.add_column("sweeps", sa.Column("heartbeat_s", Double, nullable=True))


def downgrade() -> None:
    # SQLite >= 3.35; no view names either column
    op.drop_column("sweeps", "heartbeat_s")
    op.drop_column("trials", "heartbeat_at")
