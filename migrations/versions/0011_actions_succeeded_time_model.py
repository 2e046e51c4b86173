"""Fleet ranking by succeeded actions: a partial covering index of the succeeded actions by (time, model).

``actions_succeeded_time_model`` on ``(coalesce(not_before, updated_at), model_id) INCLUDE (not_before,
updated_at) WHERE status = 'succeeded'``: ``GET /v1/fleet?sort=actions_succeeded`` counts a window's
succeeded actions per model for the whole fleet. 0009's ``actions_time`` finds the window's rows but fetches
each one from the heap for ``status`` and ``model_id``; this index answers the count by an index-only scan
of the window's succeeded actions alone (the included columns let PostgreSQL recheck the expression without
the heap). Measured at 100,000 models with 400,000 succeeded actions in the window, one core: the scan of
the window's succeeded actions from 70 ms (sequential scan with a filter) to 27-46 ms; the planner picks it
with the ranking's ``random_page_cost`` (``forecaster.store.dashboard``). Its order (time first) keeps the
count proportional to the window's actions, not to all of history. It is kept beside ``actions_time``, which
serves every status.

Plain ``CREATE INDEX`` locks the table against writes while it builds; on a large existing table, build it
``CONCURRENTLY`` by hand first (same name), and this migration's ``IF NOT EXISTS`` then does nothing.
A concurrent build that failed or was cancelled leaves an INVALID index of that name, which this migration drops
and builds again, plainly (``migrations/indexes.py``): check ``pg_index.indisvalid`` after a hand-built one.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03
"""

from alembic import op

from migrations.indexes import create_index_if_not_exists

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

# Copied from forecaster.store.dashboard.ACTION_TIME_SQL (a migration is frozen once released).
ACTION_TIME_SQL = "coalesce(not_before, updated_at)"


def upgrade() -> None:
    create_index_if_not_exists("CREATE INDEX IF NOT EXISTS actions_succeeded_time_model "
                               f"ON actions (({ACTION_TIME_SQL}), model_id) "
                               "INCLUDE (not_before, updated_at) WHERE status = 'succeeded'")


def downgrade() -> None:
    op.execute("DROP INDEX IF EXISTS actions_succeeded_time_model")
