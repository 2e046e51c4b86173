"""Dashboard at fleet scale: indexes for the fleet ranking's window reads and for "where does the data end".

* ``coverage_known_until`` on ``upper(ranges)``: the newest known count of any model (the dashboard's windows
  follow it when nothing recent is stored, e.g. a 2019 trace served in 2026) is one index probe instead of a
  scan of every model's coverage row.
* ``cold_starts_time`` on ``started_at`` and ``actions_time`` on the timeline time: ranking the fleet by cold
  starts or succeeded actions over a window reads the window's rows of every model; the existing
  ``(model_id, time)`` indexes serve one model at a time only.

Plain ``CREATE INDEX`` locks the table against writes while it builds; on a large existing table, build it
``CONCURRENTLY`` by hand first (same name), and this migration's ``IF NOT EXISTS`` then does nothing.
A concurrent build that failed or was cancelled leaves an INVALID index of that name, which this migration drops
and builds again, plainly (``migrations/indexes.py``): check ``pg_index.indisvalid`` after a hand-built one.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01
"""

from alembic import op

from migrations.indexes import create_index_if_not_exists

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

# Copied from forecaster.store.dashboard.ACTION_TIME_SQL (a migration is frozen once released).
ACTION_TIME_SQL = "coalesce(not_before, updated_at)"


def upgrade() -> None:
    create_index_if_not_exists("CREATE INDEX IF NOT EXISTS coverage_known_until ON coverage ((upper(ranges)))")
    create_index_if_not_exists("CREATE INDEX IF NOT EXISTS cold_starts_time ON cold_starts (started_at)")
    create_index_if_not_exists(f"CREATE INDEX IF NOT EXISTS actions_time ON actions (({ACTION_TIME_SQL}))")


def downgrade() -> None:
    op.execute("DROP INDEX IF EXISTS actions_time")
    op.execute("DROP INDEX IF EXISTS cold_starts_time")
    op.execute("DROP INDEX IF EXISTS coverage_known_until")
