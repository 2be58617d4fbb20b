"""Ownership and leases: the database's identity, where each sweep came from, and the
one driver that may run a sweep.

Revision ID: 0009_ownership
Revises: 0008_factors
Create Date: 2026-12-07

* ``database_info``: one row, the database's ``identity`` (a random hex id made when the
  revision is applied, or when qkgeom creates the file). qkgeom stamps it in the
  directories it creates for a sweep (``.qkgeom-owner.json``), so ``qkgeom sweep
  delete`` can tell its own files from those of a database it was merged from.
* ``sweeps.origin``: the identity of the database whose driver created the sweep and its
  files. ``qkgeom db merge`` carries it; NULL for sweeps recorded before this revision
  (their files are judged as before, without a stamp).
* ``sweep_leases``: the driver that holds a sweep (host, pid, a random token, when it took
  the lease and its last heartbeat, both read from the database's own clock). A resume
  refuses while a live driver holds the lease (qkgeom.store.lease).

Frozen: this file must not import qkgeom's models.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timezone

import sqlalchemy as sa
from alembic import op

revision = "0009_ownership"
down_revision = "0008_factors"
branch_labels = None
depends_on = None


def upgrade() -> None:
    info = op.create_table(
        "database_info",
        sa.Column("key", sa.String(64), nullable=False),
        sa.Column("value", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("key", name="pk_database_info"),
    )
    op.bulk_insert(info, [{"key": "identity", "value": uuid.uuid4().hex},
                          {"key": "created_at",
                           "value": datetime.now(timezone.utc).isoformat()}])
    op.add_column("sweeps", sa.Column("origin", sa.String(64), nullable=True))
    op.create_table(
        "sweep_leases",
        sa.Column("sweep_id", sa.Integer(), nullable=False),
        sa.Column("token", sa.String(64), nullable=False),
        sa.Column("host", sa.String(200), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("command", sa.String(200), nullable=True),
        sa.Column("taken_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("stale_after_s", sa.Float(precision=53), nullable=False),
        sa.ForeignKeyConstraint(["sweep_id"], ["sweeps.id"], ondelete="CASCADE",
                                name="fk_sweep_leases_sweep_id_sweeps"),
        sa.PrimaryKeyConstraint("sweep_id", name="pk_sweep_leases"),
    )


def downgrade() -> None:
    op.drop_table("sweep_leases")
    op.drop_column("sweeps", "origin")  # SQLite >= 3.35; no view names the column
    op.drop_table("database_info")
