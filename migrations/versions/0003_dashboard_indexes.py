"""Dashboard indexes: forecasts by (model, horizon, target minute); actions by (model, time).

The forecast job writes one run per model per minute with up to 60 target
minutes, so "the forecast made h minutes ahead of each minute of a week" is
one row in 60 of the model's rows. Indexing the horizon expression lets the
dashboard's series and fleet reads fetch exactly the rows they show. The
expression must stay identical to ``forecaster.store.dashboard.HORIZON_MIN_SQL``
for the planner to use the index (it is copied, not imported: a migration is
frozen once released).

Plain ``CREATE INDEX`` locks the table against writes while it builds; on a
large existing ``forecasts`` table, build it ``CONCURRENTLY`` by hand first
(same name), and this migration's ``IF NOT EXISTS`` then does nothing. A
concurrent build that failed or was cancelled leaves an INVALID index of that
name, which this migration drops and builds again, plainly
(``migrations/indexes.py``): check ``pg_index.indisvalid`` after a hand-built one.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

from alembic import op

from migrations.indexes import create_index_if_not_exists

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

HORIZON_MIN_SQL = "CAST(ceil(EXTRACT(EPOCH FROM (target_minute - issued_at)) / 60) AS integer)"


def upgrade() -> None:
    create_index_if_not_exists("CREATE INDEX IF NOT EXISTS forecasts_model_horizon_target "
                               f"ON forecasts (model_id, ({HORIZON_MIN_SQL}), target_minute)")
    create_index_if_not_exists("CREATE INDEX IF NOT EXISTS actions_model_time "
                               "ON actions (model_id, (coalesce(not_before, updated_at)))")


def downgrade() -> None:
    op.execute("DROP INDEX IF EXISTS actions_model_time")
    op.execute("DROP INDEX IF EXISTS forecasts_model_horizon_target")
