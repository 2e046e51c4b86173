"""Initial schema: catalogue, partitioned invocations, coverage, cold starts, nodes, forecasts, plans, jobs.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

TZ = sa.DateTime(timezone=True)


def _created() -> sa.Column:
    return sa.Column("created_at", TZ, server_default=sa.func.now(), nullable=False)


def upgrade() -> None:
    op.create_table(
        "serving_models",
        sa.Column("id", sa.String(256), primary_key=True),
        sa.Column("image_ref", sa.Text),
        sa.Column("image_size_bytes", sa.BigInteger, sa.CheckConstraint("image_size_bytes >= 0")),
        sa.Column("weights_uri", sa.Text),
        sa.Column("weights_size_bytes", sa.BigInteger, sa.CheckConstraint("weights_size_bytes >= 0")),
        sa.Column("gpus_per_replica", sa.Integer, sa.CheckConstraint("gpus_per_replica >= 0"), nullable=False,
                  server_default="1"),
        sa.Column("replica_rps", sa.Float, sa.CheckConstraint("replica_rps > 0")),
        sa.Column("cold_start_slo_s", sa.Float, sa.CheckConstraint("cold_start_slo_s > 0")),
        sa.Column("labels", postgresql.JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
        _created(),
        sa.Column("updated_at", TZ, server_default=sa.func.now(), nullable=False),
    )

    # Range-partitioned by day; partitions are created ahead by the maintenance job
    # and on demand by ingest (forecaster.store.partitions).
    op.create_table(
        "invocations",
        sa.Column("model_id", sa.String(256), sa.ForeignKey("serving_models.id", ondelete="CASCADE"),
                  nullable=False),
        sa.Column("minute", TZ, nullable=False),
        sa.Column("count", sa.BigInteger, sa.CheckConstraint("count >= 0", name="invocations_count_nonneg"),
                  nullable=False),
        sa.PrimaryKeyConstraint("model_id", "minute", name="invocations_pkey"),
        postgresql_partition_by="RANGE (minute)",
    )

    op.create_table(
        "coverage",
        sa.Column("model_id", sa.String(256), sa.ForeignKey("serving_models.id", ondelete="CASCADE"),
                  primary_key=True),
        sa.Column("source", sa.String(128), primary_key=True),
        sa.Column("step_seconds", sa.Integer, sa.CheckConstraint("step_seconds > 0"), primary_key=True),
        sa.Column("ranges", postgresql.TSTZMULTIRANGE, nullable=False),
        sa.Column("updated_at", TZ, server_default=sa.func.now(), nullable=False),
    )

    op.create_table(
        "ingest_batches",
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
        sa.Column("source", sa.String(128), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("content_sha256", sa.String(64), nullable=False, unique=True),
        sa.Column("models", sa.Integer, nullable=False),
        sa.Column("rows_written", sa.BigInteger, nullable=False),
        sa.Column("invocations", sa.BigInteger, nullable=False),
        sa.Column("window_start", TZ),
        sa.Column("window_end", TZ),
        _created(),
    )

    op.create_table(
        "cold_starts",
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
        sa.Column("model_id", sa.String(256), sa.ForeignKey("serving_models.id", ondelete="CASCADE"),
                  nullable=False),
        sa.Column("node_id", sa.String(256), nullable=False),
        sa.Column("started_at", TZ, nullable=False),
        sa.Column("total_seconds", sa.Float, sa.CheckConstraint("total_seconds >= 0"), nullable=False),
        *[
            sa.Column(phase, sa.Float, sa.CheckConstraint(f"{phase} >= 0"))
            for phase in ("image_pull_s", "weight_fetch_s", "weight_load_s", "runtime_init_s", "registration_s")
        ],
        sa.Column("cache_state", sa.String(32)),
        sa.Column("source", sa.String(128), nullable=False),
        _created(),
        # One event per replica start: the same observation pushed twice is one row.
        sa.UniqueConstraint("model_id", "node_id", "started_at", name="cold_starts_event_key"),
    )
    op.create_index("cold_starts_model_time", "cold_starts", ["model_id", "started_at"])

    op.create_table(
        "nodes",
        sa.Column("id", sa.String(256), primary_key=True),
        sa.Column("gpus_total", sa.Integer, nullable=False, server_default="0"),
        sa.Column("gpus_free", sa.Integer, nullable=False, server_default="0"),
        sa.Column("disk_free_bytes", sa.BigInteger),
        sa.Column("host_memory_free_bytes", sa.BigInteger),
        sa.Column("network_bytes_per_s", sa.Float),
        sa.Column("labels", postgresql.JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
        sa.Column("updated_at", TZ, server_default=sa.func.now(), nullable=False),
        sa.CheckConstraint("gpus_free >= 0 AND gpus_free <= gpus_total", name="nodes_gpus_free_range"),
    )

    op.create_table(
        "node_cache",
        sa.Column("node_id", sa.String(256), sa.ForeignKey("nodes.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("artefact_kind", sa.String(16), sa.CheckConstraint("artefact_kind IN ('image', 'weights')"),
                  primary_key=True),
        sa.Column("ref", sa.Text, primary_key=True),
        sa.Column("tier", sa.String(16), sa.CheckConstraint("tier IN ('image', 'disk', 'host', 'gpu')"),
                  primary_key=True),
        sa.Column("size_bytes", sa.BigInteger),
        sa.Column("in_use", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("updated_at", TZ, server_default=sa.func.now(), nullable=False),
    )

    op.create_table(
        "model_versions",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("path", sa.Text, nullable=False),
        sa.Column("train_start", TZ),
        sa.Column("train_end", TZ),
        sa.Column("members", postgresql.JSONB, nullable=False, server_default=sa.text("'[]'::jsonb")),
        sa.Column("scores", postgresql.JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
        sa.Column("code_version", sa.String(64)),
        _created(),
    )
    # At most one champion at a time.
    op.create_index("model_versions_one_champion", "model_versions", ["status"], unique=True,
                    postgresql_where=sa.text("status = 'champion'"))

    op.create_table(
        "forecasts",
        sa.Column("model_id", sa.String(256), sa.ForeignKey("serving_models.id", ondelete="CASCADE"),
                  primary_key=True),
        sa.Column("issued_at", TZ, primary_key=True),
        sa.Column("target_minute", TZ, primary_key=True),
        sa.Column("model_version_id", sa.String(64), sa.ForeignKey("model_versions.id")),
        sa.Column("point", sa.Float, nullable=False),
        sa.Column("p_any", sa.Float),
        sa.Column("quantiles", postgresql.JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    )

    op.create_table(
        "plans",
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
        sa.Column("planned_at", TZ, nullable=False),
        sa.Column("summary", postgresql.JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
        _created(),
    )
    op.create_table(
        "actions",
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
        sa.Column("plan_id", sa.BigInteger, sa.ForeignKey("plans.id", ondelete="SET NULL")),
        sa.Column("kind", sa.String(16), sa.CheckConstraint("kind IN ('prepull', 'preload', 'scale', 'release')"),
                  nullable=False),
        sa.Column("model_id", sa.String(256)),
        sa.Column("node_id", sa.String(256)),
        sa.Column("target", sa.Text),
        sa.Column("spec", postgresql.JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
        sa.Column("not_before", TZ),
        sa.Column("deadline", TZ),
        sa.Column("reason", sa.String(64)),
        sa.Column("expected_benefit", sa.Float),
        sa.Column("expected_cost", sa.Float),
        sa.Column("status", sa.String(16), nullable=False, server_default="pending"),
        sa.Column("status_reason", sa.String(64)),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("updated_at", TZ, server_default=sa.func.now(), nullable=False),
    )
    op.create_index("actions_plan", "actions", ["plan_id"])
    op.create_index("actions_status_deadline", "actions", ["status", "deadline"])

    op.create_table(
        "job_runs",
        sa.Column("job_name", sa.String(64), primary_key=True),
        sa.Column("slot", TZ, primary_key=True),
        sa.Column("started_at", TZ, server_default=sa.func.now(), nullable=False),
        sa.Column("finished_at", TZ),
        sa.Column("status", sa.String(16), nullable=False, server_default="running"),
        sa.Column("detail", postgresql.JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    )

    # API bearer tokens: only a SHA-256 of the token is stored; scopes read | ingest | admin.
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
        sa.Column("name", sa.String(128), nullable=False, unique=True),
        sa.Column("token_sha256", sa.String(64), nullable=False, unique=True),
        sa.Column("scopes", postgresql.ARRAY(sa.String(16)), nullable=False),
        sa.Column("revoked", sa.Boolean, nullable=False, server_default=sa.false()),
        _created(),
        sa.Column("last_used_at", TZ),
    )

    # APScheduler 3's SQLAlchemyJobStore schema; it finds the table and creates nothing.
    op.create_table(
        "apscheduler_jobs",
        sa.Column("id", sa.Unicode(191), primary_key=True),
        sa.Column("next_run_time", sa.Float(25), index=True),
        sa.Column("job_state", sa.LargeBinary, nullable=False),
    )


def downgrade() -> None:
    for table in (
        "apscheduler_jobs", "api_tokens", "job_runs", "actions", "plans", "forecasts", "model_versions",
        "node_cache", "nodes", "cold_starts", "ingest_batches", "coverage", "invocations", "serving_models",
    ):
        op.drop_table(table)
