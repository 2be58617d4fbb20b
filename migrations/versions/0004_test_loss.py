"""trials.test_loss: the final test loss of each trial; v_final shows it.

Revision ID: 0004_test_loss
Revises: 0003_checkpoint_kind
Create Date: 2026-12-03

``train()`` measures the loss on the held-out evaluation split once training ends; this
column keeps it (nats/char; NULL until the trial finishes, or NaN). ``v_final`` is
recreated with a ``test_loss`` column. Frozen: this file must not import qkgeom's models.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0004_test_loss"
down_revision = "0003_checkpoint_kind"
branch_labels = None
depends_on = None

Double = sa.Float(precision=53).with_variant(postgresql.DOUBLE_PRECISION(), "postgresql")

V_FINAL_0002 = """
SELECT s.name AS sweep, m.trial_id, t.depth, t.init, t.arm, t.seed, m.layer, m.metric,
       m.step, m.value
FROM probe_metrics m
JOIN (SELECT trial_id, MAX(step) AS step FROM probes GROUP BY trial_id) last
  ON last.trial_id = m.trial_id AND last.step = m.step
JOIN trials t ON t.id = m.trial_id
JOIN sweeps s ON s.id = t.sweep_id
WHERE m.head_key = -1
"""

V_FINAL = """
SELECT s.name AS sweep, m.trial_id, t.depth, t.init, t.arm, t.seed, m.layer, m.metric,
       m.step, m.value, t.test_loss
FROM probe_metrics m
JOIN (SELECT trial_id, MAX(step) AS step FROM probes GROUP BY trial_id) last
  ON last.trial_id = m.trial_id AND last.step = m.step
JOIN trials t ON t.id = m.trial_id
JOIN sweeps s ON s.id = t.sweep_id
WHERE m.head_key = -1
"""


def upgrade() -> None:
    op.execute("DROP VIEW IF EXISTS v_final")
    # plain ALTER TABLE on both backends: a batch copy of trials would trip over the views
    # and foreign keys that name it
    op.add_column("trials", sa.Column("test_loss", Double, nullable=True))
    op.execute(f"CREATE VIEW v_final AS {V_FINAL.strip()}")


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS v_final")
    op.drop_column("trials", "test_loss")  # SQLite >= 3.35: no view names the column now
    op.execute(f"CREATE VIEW v_final AS {V_FINAL_0002.strip()}")
