"""trials.baseline_ref: which baseline an arm's target came from.

Revision ID: 0005_baseline_ref
Revises: 0004_test_loss
Create Date: 2026-12-04

An arm whose target is a fraction of its paired baseline's trajectory (``target_mode:
baseline_fraction``) records the baseline it was filled from: ``{"trial": key, "attempt":
n, "metric": "pr_wk" | "pr_k", "digest": ..., "experiment": ...}`` (JSON; NULL for every
other trial). The sweep and the report compare the digest with the baseline's stored
trajectory (qkgeom.pairing). Frozen: this file must not import qkgeom's models.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0005_baseline_ref"
down_revision = "0004_test_loss"
branch_labels = None
depends_on = None

JSONType = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    # plain ALTER TABLE on both backends (a batch copy of trials would trip over the views)
    op.add_column("trials", sa.Column("baseline_ref", JSONType, nullable=True))


def downgrade() -> None:
    op.drop_column("trials", "baseline_ref")  # SQLite >= 3.35; no view names the column
