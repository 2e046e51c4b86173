"""Retention of the audit trail and the scheduler's history: what the hourly retention job needs to delete old
plans, finished actions and job runs in small batches, to keep ``/metrics``' action counter from falling, and the
audit trail's newest page without a scan of what is kept.

Nothing deleted plans, actions or job runs (at 100,000 models the plan job leaves about 360,000 actions a day; the
scheduler about 5,800 runs). :mod:`forecaster.store.history_retention` now deletes those older than
``PREWARM_PLANS_RETENTION_DAYS`` / ``PREWARM_JOB_RUNS_RETENTION_DAYS``, oldest first, through two indexes:

* ``actions_finished_age`` on ``(coalesce(finished_at, updated_at), id)`` of the finished actions (succeeded,
  failed, dropped): a batch is the next range of it, not a scan of the table for old rows;
* ``plans_planned_at`` on ``(planned_at, id)``: the same for plans, and ``/metrics``' newest plan (a scan and a
  sort of every plan per scrape before);
* ``actions_updated`` on ``(updated_at DESC, id DESC)``: ``GET /v1/actions``' page of the newest updated actions
  without a filter, which sorted every action kept (483 ms a call at 2,000,000; 30 days at 100,000 models keep
  about 11,000,000).

``action_counts.pruned`` counts, per kind and status, the actions deleted from the table (by retention or by a
demo replay clearing its window): ``/metrics`` reports a finished status as ``n + pruned``, so the counter
``prewarm_actions_total`` never falls when rows go (a fall reads as a counter reset to Prometheus' ``rate``).
The scheduler's recount at start (``reconcile_action_state``) recounts ``n`` and leaves ``pruned``.

Plain ``CREATE INDEX`` locks the table against writes while it builds; on a large existing table, build the
indexes ``CONCURRENTLY`` by hand first (same names), and this migration's ``IF NOT EXISTS`` then does nothing.
A concurrent build that failed or was cancelled leaves an INVALID index of that name, which this migration drops
and builds again, plainly (``migrations/indexes.py``): check ``pg_index.indisvalid`` after a hand-built one.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-06
"""

from alembic import op
import sqlalchemy as sa

from migrations.indexes import create_index_if_not_exists

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    create_index_if_not_exists("CREATE INDEX IF NOT EXISTS actions_finished_age "
                               "ON actions ((coalesce(finished_at, updated_at)), id) "
                               "WHERE status IN ('succeeded', 'failed', 'dropped')")
    create_index_if_not_exists("CREATE INDEX IF NOT EXISTS plans_planned_at ON plans (planned_at, id)")
    create_index_if_not_exists("CREATE INDEX IF NOT EXISTS actions_updated ON actions (updated_at DESC, id DESC)")
    op.add_column("action_counts", sa.Column("pruned", sa.BigInteger, nullable=False, server_default="0"))


def downgrade() -> None:
    op.drop_column("action_counts", "pruned")
    op.execute("DROP INDEX IF EXISTS actions_updated")
    op.execute("DROP INDEX IF EXISTS plans_planned_at")
    op.execute("DROP INDEX IF EXISTS actions_finished_age")
