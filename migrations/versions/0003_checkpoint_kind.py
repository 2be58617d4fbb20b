"""checkpoints.kind: 'resume' (Tune's training state, pruned) or 'snapshot' (weights kept).

Revision ID: 0003_checkpoint_kind
Revises: 0002_views
Create Date: 2026-12-03

Every existing row was written for a Tune checkpoint, so it becomes kind 'resume'. The
primary key grows to (trial_id, kind, step): a probe step can have both kinds.
Frozen: this file must not import qkgeom's models.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_checkpoint_kind"
down_revision = "0002_views"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("checkpoints", recreate="auto") as b:
        b.add_column(sa.Column("kind", sa.String(20), nullable=False,
                               server_default="resume"))
        b.drop_constraint("pk_checkpoints", type_="primary")
        b.create_primary_key("pk_checkpoints", ["trial_id", "kind", "step"])
        b.create_check_constraint("ck_checkpoints_kind", "kind IN ('resume', 'snapshot')")


def downgrade() -> None:
    # one row per (trial, step) again: where both kinds exist, the snapshot stays (it is
    # the one that is never pruned)
    op.execute(
        "DELETE FROM checkpoints WHERE kind = 'resume' AND EXISTS (SELECT 1 FROM checkpoints c2 "
        "WHERE c2.trial_id = checkpoints.trial_id AND c2.step = checkpoints.step "
        "AND c2.kind = 'snapshot')"
    )
    with op.batch_alter_table("checkpoints", recreate="auto") as b:
        b.drop_constraint("ck_checkpoints_kind", type_="check")
        b.drop_constraint("pk_checkpoints", type_="primary")
        b.create_primary_key("pk_checkpoints", ["trial_id", "step"])
        b.drop_column("kind")
