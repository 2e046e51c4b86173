"""Forecasts as one row per model and run (arrays), range-partitioned by day of ``issued_at``.

The forecast job writes a 60-minute run per model every minute. With one row
per (model, run, target minute) that is 6,000,000 rows a minute at 100,000
models, more than one job period can write. Here a run is one row: element
``k`` (1-based) of ``point``, ``p_any`` and of each row of ``quantiles`` is the
target minute ``first_target + (k - 1) * step_seconds``; ``quantiles`` holds
one row per level, in the order of ``quantile_levels``. Daily partitions
(``forecasts_YYYYMMDD``, UTC days) let retention drop a whole day at once
instead of deleting rows (``forecaster.store.forecasts``).

Existing rows are converted: the rows of one (model, issued_at) become one
run spanning its first to its last target minute; a minute missing inside that
span becomes a NULL element. Downgrade converts back (NULL elements are left
out) and restores migration 0003's horizon index, which belonged to the old
table only; 0003's ``actions_model_time`` index is not touched.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30
"""

from datetime import timedelta

from alembic import op
from sqlalchemy import text

from migrations.indexes import create_index_if_not_exists

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

# Copied from 0003 (a migration is frozen once released), for the downgrade.
HORIZON_MIN_SQL = "CAST(ceil(EXTRACT(EPOCH FROM (target_minute - issued_at)) / 60) AS integer)"

# A JSON key of the old ``quantiles`` object that reads as a number.
NUMERIC_KEY = r"'^[0-9]*\.?[0-9]+([eE][-+]?[0-9]+)?$'"


def _create_partitions(table: str) -> None:
    """Create the daily partitions (UTC days) of ``forecasts`` for the runs in ``table``."""
    conn = op.get_bind()
    days = conn.execute(text(
        f"SELECT DISTINCT (issued_at AT TIME ZONE 'UTC')::date FROM {table} ORDER BY 1")).scalars().all()
    for day in days:
        conn.execute(text(
            f'CREATE TABLE "forecasts_{day:%Y%m%d}" PARTITION OF forecasts '
            f"FOR VALUES FROM ('{day.isoformat()} 00:00+00') TO ('{day + timedelta(days=1)} 00:00+00')"))


def upgrade() -> None:
    op.execute("DROP INDEX IF EXISTS forecasts_model_horizon_target")  # 0003's index on the old table only
    op.execute("ALTER TABLE forecasts RENAME TO forecasts_rows")
    op.execute("ALTER TABLE forecasts_rows RENAME CONSTRAINT forecasts_pkey TO forecasts_rows_pkey")
    op.execute("""
        CREATE TABLE forecasts (
            model_id varchar(256) NOT NULL REFERENCES serving_models (id) ON DELETE CASCADE,
            issued_at timestamptz NOT NULL,
            first_target timestamptz NOT NULL,
            step_seconds integer NOT NULL DEFAULT 60 CHECK (step_seconds > 0),
            model_version_id varchar(64) REFERENCES model_versions (id),
            point real[] NOT NULL,
            p_any real[],
            quantile_levels real[] NOT NULL,
            quantiles real[][] NOT NULL,
            CONSTRAINT forecasts_pkey PRIMARY KEY (model_id, issued_at)
        ) PARTITION BY RANGE (issued_at)
    """)
    op.execute("CREATE INDEX forecasts_issued_at ON forecasts (issued_at)")
    _create_partitions("forecasts_rows")
    op.execute(f"""
        WITH runs AS (
            SELECT model_id, issued_at, min(target_minute) AS first_target, max(target_minute) AS last_target,
                   max(model_version_id) AS model_version_id, bool_or(p_any IS NOT NULL) AS has_p_any
            FROM forecasts_rows GROUP BY model_id, issued_at
        ), cells AS (
            SELECT r.model_id, r.issued_at, r.first_target, r.model_version_id, r.has_p_any, s.t,
                   o.point, o.p_any, o.quantiles
            FROM runs r
            CROSS JOIN LATERAL generate_series(r.first_target, r.last_target, interval '1 minute') AS s(t)
            LEFT JOIN forecasts_rows o
                   ON o.model_id = r.model_id AND o.issued_at = r.issued_at AND o.target_minute = s.t
        ), keys AS (
            SELECT DISTINCT o.model_id, o.issued_at, k.key
            FROM forecasts_rows o CROSS JOIN LATERAL jsonb_object_keys(o.quantiles) AS k(key)
            WHERE k.key ~ {NUMERIC_KEY}
        ), per_level AS (
            SELECT c.model_id, c.issued_at, k.key,
                   array_agg(CAST(c.quantiles ->> k.key AS real) ORDER BY c.t) AS vals
            FROM cells c JOIN keys k ON k.model_id = c.model_id AND k.issued_at = c.issued_at
            GROUP BY c.model_id, c.issued_at, k.key
        ), q AS (
            SELECT model_id, issued_at, array_agg(CAST(key AS real) ORDER BY CAST(key AS real)) AS levels,
                   array_agg(vals ORDER BY CAST(key AS real)) AS quantiles
            FROM per_level GROUP BY model_id, issued_at
        ), p AS (
            SELECT model_id, issued_at, first_target, model_version_id, has_p_any,
                   array_agg(CAST(point AS real) ORDER BY t) AS point,
                   array_agg(CAST(p_any AS real) ORDER BY t) AS p_any
            FROM cells GROUP BY model_id, issued_at, first_target, model_version_id, has_p_any
        )
        INSERT INTO forecasts (model_id, issued_at, first_target, step_seconds, model_version_id, point, p_any,
                               quantile_levels, quantiles)
        SELECT p.model_id, p.issued_at, p.first_target, 60, p.model_version_id, p.point,
               CASE WHEN p.has_p_any THEN p.p_any END,
               coalesce(q.levels, CAST('{{}}' AS real[])), coalesce(q.quantiles, CAST('{{}}' AS real[]))
        FROM p LEFT JOIN q ON q.model_id = p.model_id AND q.issued_at = p.issued_at
    """)
    op.execute("DROP TABLE forecasts_rows")


def downgrade() -> None:
    op.execute("ALTER TABLE forecasts RENAME TO forecasts_runs")
    op.execute("ALTER TABLE forecasts_runs RENAME CONSTRAINT forecasts_pkey TO forecasts_runs_pkey")
    # As migration 0001 created it.
    op.execute("""
        CREATE TABLE forecasts (
            model_id varchar(256) NOT NULL REFERENCES serving_models (id) ON DELETE CASCADE,
            issued_at timestamptz NOT NULL,
            target_minute timestamptz NOT NULL,
            model_version_id varchar(64) REFERENCES model_versions (id),
            point double precision NOT NULL,
            p_any double precision,
            quantiles jsonb NOT NULL DEFAULT '{}'::jsonb,
            CONSTRAINT forecasts_pkey PRIMARY KEY (model_id, issued_at, target_minute)
        )
    """)
    op.execute("""
        INSERT INTO forecasts (model_id, issued_at, target_minute, model_version_id, point, p_any, quantiles)
        SELECT r.model_id, r.issued_at, r.first_target + (i - 1) * r.step_seconds * interval '1 second',
               r.model_version_id, r.point[i], r.p_any[i],
               coalesce((SELECT jsonb_object_agg(CAST(r.quantile_levels[j] AS text), r.quantiles[j][i])
                         FROM generate_subscripts(r.quantile_levels, 1) AS j
                         WHERE r.quantiles[j][i] IS NOT NULL), '{}'::jsonb)
        FROM forecasts_runs r CROSS JOIN LATERAL generate_subscripts(r.point, 1) AS i
        WHERE r.point[i] IS NOT NULL
    """)
    op.execute("DROP TABLE forecasts_runs")  # and its partitions
    create_index_if_not_exists("CREATE INDEX IF NOT EXISTS forecasts_model_horizon_target "
                               f"ON forecasts (model_id, ({HORIZON_MIN_SQL}), target_minute)")
