"""The GPUs each model holds ahead of its reactive ask, kept per model instead of recomputed from all actions.

The actuator's GPU-budget guardrail asks, for every scale or release it binds, how many GPUs the other models hold
above their reactive ask: per model, the ``ahead_gpus`` of its latest succeeded or running scale or release. That
was a ``DISTINCT ON (model_id)`` over every scale and release ever recorded, once per bound action; nothing deletes
actions, so its cost grew with the history (``bench/planjob.py --action-history``: at 10,000 models with 300,000
past actions the actuation stage took 6-8 s a minute, all of it this query, 164 times).

``model_ahead_gpus`` holds one row per model whose latest such action holds GPUs ahead (none for 0), written in
the transaction that marks, reaps or deletes a model's scale or release
(:func:`forecaster.store.actions.refresh_ahead`), which finds the latest one through the partial index
``actions_scale_latest`` on ``(model_id, coalesce(finished_at, started_at) DESC NULLS LAST, id DESC)``. The
upgrade fills it from the history with the query it replaces.

Plain ``CREATE INDEX`` locks the table against writes while it builds; on a large existing table, build it
``CONCURRENTLY`` by hand first (same name), and this migration's ``IF NOT EXISTS`` then does nothing.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-06
"""

from alembic import op
import sqlalchemy as sa

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

# Copied from forecaster.store.actions (a migration is frozen once released).
COUNTS = "kind IN ('scale', 'release') AND status IN ('succeeded', 'running') AND detail ? 'ahead_gpus'"
LATEST = "coalesce(finished_at, started_at) DESC NULLS LAST, id DESC"


def upgrade() -> None:
    op.execute(f"CREATE INDEX IF NOT EXISTS actions_scale_latest ON actions (model_id, {LATEST}) WHERE {COUNTS}")
    op.create_table(
        "model_ahead_gpus",
        sa.Column("model_id", sa.String(256), primary_key=True),
        sa.Column("ahead_gpus", sa.Integer, nullable=False),
        sa.Column("action_id", sa.BigInteger, nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.CheckConstraint("ahead_gpus <> 0", name="model_ahead_gpus_nonzero"),
    )
    op.execute(f"INSERT INTO model_ahead_gpus (model_id, ahead_gpus, action_id) "
               f"SELECT model_id, gpus, id FROM (SELECT DISTINCT ON (model_id) model_id, id, "
               f"coalesce((detail->>'ahead_gpus')::int, 0) AS gpus FROM actions WHERE {COUNTS} "
               f"AND model_id IS NOT NULL ORDER BY model_id, {LATEST}) latest WHERE gpus <> 0")


def downgrade() -> None:
    op.drop_table("model_ahead_gpus")
    op.execute("DROP INDEX IF EXISTS actions_scale_latest")
