"""Forecast-error rollup: per model, horizon and target hour, the sums the dashboard's error figures are made of.

``forecast_errors`` holds, per (horizon, target hour, model), the minutes scored and the sums of |error|,
actuals and forecasts over them, exactly as the dashboard's direct computation defines them
(``forecaster.store.dashboard``); ``forecast_error_hours`` records which hours were scored, for which
horizons, and up to which ingest batch the counts were seen, so that the scoring job re-scores an hour when
later counts arrive. The fleet ranking by error then sums a window's hours instead of reading every model's
forecast runs for every minute.

The primary key leads with ``(horizon_min, hour)``: the ranking reads one horizon over a few hours for the
whole fleet (a range of the key), and a re-score replaces one hour (the same range per horizon). No foreign
key to ``serving_models``: it would cost one probe per inserted row (600,000 per hour at 100,000 models) and
the ranking joins ``serving_models`` anyway; rows of a removed model age out with the rollup's retention.

``cold_starts_time_model`` on ``(started_at, model_id)``: the fleet ranking by cold starts counts a window's
starts per model; with the model id in the index that count is an index-only scan instead of a heap fetch
per start (0009's ``cold_starts_time`` on ``started_at`` alone is dropped: this one serves its queries too).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02
"""

from alembic import op
import sqlalchemy as sa

from migrations.indexes import create_index_if_not_exists

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "forecast_errors",
        sa.Column("horizon_min", sa.SmallInteger, primary_key=True),
        sa.Column("hour", sa.DateTime(timezone=True), primary_key=True),
        sa.Column("model_id", sa.String(256), primary_key=True),
        sa.Column("scored_minutes", sa.SmallInteger, nullable=False),
        sa.Column("abs_error", sa.Float, nullable=False),
        sa.Column("actual", sa.Float, nullable=False),
        sa.Column("forecast", sa.Float, nullable=False),
        sa.CheckConstraint("scored_minutes > 0 AND scored_minutes <= 60", name="forecast_errors_minutes_in_hour"),
        sa.CheckConstraint("date_trunc('hour', hour AT TIME ZONE 'UTC') = hour AT TIME ZONE 'UTC'",
                           name="forecast_errors_whole_hour"),
    )
    op.create_table(
        "forecast_error_hours",
        sa.Column("hour", sa.DateTime(timezone=True), primary_key=True),
        sa.Column("horizons_min", sa.ARRAY(sa.SmallInteger), nullable=False),
        sa.Column("batch_watermark", sa.BigInteger, nullable=False),
        sa.Column("models", sa.Integer, nullable=False),
        sa.Column("scored_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.Column("seconds", sa.Float, nullable=False),
    )
    create_index_if_not_exists("CREATE INDEX IF NOT EXISTS cold_starts_time_model "
                               "ON cold_starts (started_at, model_id)")
    op.execute("DROP INDEX IF EXISTS cold_starts_time")


def downgrade() -> None:
    create_index_if_not_exists("CREATE INDEX IF NOT EXISTS cold_starts_time ON cold_starts (started_at)")
    op.execute("DROP INDEX IF EXISTS cold_starts_time_model")
    op.drop_table("forecast_error_hours")
    op.drop_table("forecast_errors")
