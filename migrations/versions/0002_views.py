"""Views for the common questions: v_metrics, v_layer_metrics, v_head_means,
v_trajectories, v_final, v_pretrained (documented in docs/schema.md).

Revision ID: 0002_views
Revises: 0001_initial
Create Date: 2025-12-02

Portable SQL (SQLite and PostgreSQL). Layer-level rows are ``head_key = -1`` (head NULL).
Float NULL means NaN (see qkgeom/store/models.py), so AVG and COUNT(value) skip NaNs.
Frozen: this file must not import qkgeom's models.
"""

from __future__ import annotations

from alembic import op

revision = "0002_views"
down_revision = "0001_initial"
branch_labels = None
depends_on = None

VIEWS = {
    "v_metrics": """
SELECT s.name AS sweep, t.sweep_id, m.trial_id, t.trial_key, t.depth, t.init, t.arm,
       t.seed, t.status, m.step, m.progress, m.layer, m.head, m.metric, m.value
FROM probe_metrics m
JOIN trials t ON t.id = m.trial_id
JOIN sweeps s ON s.id = t.sweep_id
""",
    "v_layer_metrics": """
SELECT s.name AS sweep, t.sweep_id, m.trial_id, t.trial_key, t.depth, t.init, t.arm,
       t.seed, t.status, m.step, m.progress, m.layer, m.metric, m.value
FROM probe_metrics m
JOIN trials t ON t.id = m.trial_id
JOIN sweeps s ON s.id = t.sweep_id
WHERE m.head_key = -1
""",
    "v_head_means": """
SELECT s.name AS sweep, t.sweep_id, m.trial_id, t.depth, t.init, t.arm, t.seed,
       m.step, AVG(m.progress) AS progress, m.layer, m.metric,
       AVG(m.value) AS value, COUNT(m.value) AS n_heads
FROM probe_metrics m
JOIN trials t ON t.id = m.trial_id
JOIN sweeps s ON s.id = t.sweep_id
WHERE m.head_key >= 0
GROUP BY s.name, t.sweep_id, m.trial_id, t.depth, t.init, t.arm, t.seed, m.step,
         m.layer, m.metric
""",
    "v_trajectories": """
SELECT s.name AS sweep, t.depth, t.init, t.arm, m.layer, m.metric, m.step,
       AVG(m.progress) AS progress, AVG(m.value) AS value, COUNT(m.value) AS n_seeds
FROM probe_metrics m
JOIN trials t ON t.id = m.trial_id
JOIN sweeps s ON s.id = t.sweep_id
WHERE m.head_key = -1
GROUP BY s.name, t.depth, t.init, t.arm, m.layer, m.metric, m.step
""",
    "v_final": """
SELECT s.name AS sweep, m.trial_id, t.depth, t.init, t.arm, t.seed, m.layer, m.metric,
       m.step, m.value
FROM probe_metrics m
JOIN (SELECT trial_id, MAX(step) AS step FROM probes GROUP BY trial_id) last
  ON last.trial_id = m.trial_id AND last.step = m.step
JOIN trials t ON t.id = m.trial_id
JOIN sweeps s ON s.id = t.sweep_id
WHERE m.head_key = -1
""",
    "v_pretrained": """
SELECT r.model, r.revision, r.step, pm.layer, pm.head, pm.metric, pm.value
FROM pretrained_metrics pm
JOIN pretrained_runs r ON r.id = pm.run_id
""",
}


def upgrade() -> None:
    for name, body in VIEWS.items():
        op.execute(f"CREATE VIEW {name} AS {body.strip()}")


def downgrade() -> None:
    for name in reversed(list(VIEWS)):
        op.execute(f"DROP VIEW IF EXISTS {name}")
