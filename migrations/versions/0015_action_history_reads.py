"""Reads of the action history that do not grow with it: the GPUs each model holds ahead of its reactive ask kept per
model, the actions per kind and status kept as counts, and two partial indexes for the plan job's fleet read.

Nothing deletes actions (at 100,000 models the plan job leaves about 360,000 a day), and three per-minute reads and
every ``/metrics`` scrape scanned all of them (measured with ``bench/planjob.py --models 10000 --action-history N``, N past actions over
the 30 days before).

The actuator's GPU-budget guardrail asks, for every scale or release it binds, how many GPUs the other models hold
above their reactive ask: per model, the ``ahead_gpus`` of its latest succeeded or running scale or release. That
was a ``DISTINCT ON (model_id)`` over every scale and release ever recorded, once per bound action: with 300,000
past actions the actuation stage took 31-38 s a minute, with 1,000,000 69-83 s (the plan job over its minute).

``model_ahead_gpus`` holds one row per model whose latest such action holds GPUs ahead (none for 0), written in
the transaction that marks, reaps or deletes a model's scale or release
(:func:`forecaster.store.actions.refresh_ahead`), which finds the latest one through the partial index
``actions_scale_latest`` on ``(model_id, coalesce(finished_at, started_at) DESC NULLS LAST, id DESC)``. The
upgrade fills it from the history with the query it replaces.

The fleet read (:func:`forecaster.store.fleet.read_fleet_inputs`) takes each model's replicas from its newest
succeeded scale or release (``actions_replicas_newest``: one index entry per model instead of all its rows and a
sort) and the last day's succeeded pre-pulls and pre-loads (``actions_artefacts_recent``: the day's rows instead
of a scan of the table). With 1,000,000 past actions: 2.3 s and 118 ms, then 33 ms and 9 ms.

``/metrics`` counted every action per kind and status on each scrape (``prewarm_actions``; 100 ms per million
actions); ``action_counts`` keeps those counts, moved in the transactions that record, mark, reap or delete actions
(:func:`forecaster.store.actions.count_actions`), and the upgrade fills it with that count.

Plain ``CREATE INDEX`` locks the table against writes while it builds; on a large existing table, build the
indexes ``CONCURRENTLY`` by hand first (same names), and this migration's ``IF NOT EXISTS`` then does nothing.
A concurrent build that failed or was cancelled leaves an INVALID index of that name, which this migration drops
and builds again, plainly (``migrations/indexes.py``): check ``pg_index.indisvalid`` after a hand-built one.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-06
"""

from alembic import op
import sqlalchemy as sa

from migrations.indexes import create_index_if_not_exists

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

# Copied from forecaster.store.actions (a migration is frozen once released).
COUNTS = "kind IN ('scale', 'release') AND status IN ('succeeded', 'running') AND detail ? 'ahead_gpus'"
LATEST = "coalesce(finished_at, started_at) DESC NULLS LAST, id DESC"


def upgrade() -> None:
    create_index_if_not_exists("CREATE INDEX IF NOT EXISTS actions_scale_latest "
                               f"ON actions (model_id, {LATEST}) WHERE {COUNTS}")
    create_index_if_not_exists("CREATE INDEX IF NOT EXISTS actions_replicas_newest "
                               "ON actions (model_id, updated_at DESC, id DESC) "
                               "WHERE kind IN ('scale', 'release') AND status = 'succeeded'")
    create_index_if_not_exists("CREATE INDEX IF NOT EXISTS actions_artefacts_recent ON actions (updated_at) WHERE "
                               "kind IN ('prepull', 'preload') AND status = 'succeeded' AND node_id IS NOT NULL")
    op.create_table(
        "model_ahead_gpus",
        sa.Column("model_id", sa.String(256), primary_key=True),
        sa.Column("ahead_gpus", sa.Integer, nullable=False),
        sa.Column("action_id", sa.BigInteger, nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.CheckConstraint("ahead_gpus <> 0", name="model_ahead_gpus_nonzero"),
    )
    op.create_table(
        "action_counts",
        sa.Column("kind", sa.String(16), primary_key=True),
        sa.Column("status", sa.String(16), primary_key=True),
        sa.Column("n", sa.BigInteger, nullable=False),
    )
    op.execute("INSERT INTO action_counts (kind, status, n) SELECT kind, status, count(*) FROM actions "
               "GROUP BY kind, status")
    op.execute(f"INSERT INTO model_ahead_gpus (model_id, ahead_gpus, action_id) "
               f"SELECT model_id, gpus, id FROM (SELECT DISTINCT ON (model_id) model_id, id, "
               f"coalesce((detail->>'ahead_gpus')::int, 0) AS gpus FROM actions WHERE {COUNTS} "
               f"AND model_id IS NOT NULL ORDER BY model_id, {LATEST}) latest WHERE gpus <> 0")


def downgrade() -> None:
    op.drop_table("action_counts")
    op.drop_table("model_ahead_gpus")
    for index in ("actions_artefacts_recent", "actions_replicas_newest", "actions_scale_latest"):
        op.execute(f"DROP INDEX IF EXISTS {index}")
