"""Backtest runs and their per-series, per-horizon results.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29
"""

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "backtest_runs",
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.Column("data_start", sa.DateTime(timezone=True), nullable=False),
        sa.Column("data_end", sa.DateTime(timezone=True), nullable=False),
        sa.Column("step_seconds", sa.Integer, nullable=False),
        sa.Column("protocol", postgresql.JSONB, nullable=False),
        sa.Column("summary", postgresql.JSONB, nullable=False),
    )
    op.create_table(
        "backtest_results",
        sa.Column("run_id", sa.BigInteger, sa.ForeignKey("backtest_runs.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("method", sa.String(64), primary_key=True),
        sa.Column("unique_id", sa.String(256), primary_key=True),
        sa.Column("h", sa.Integer, primary_key=True),
        sa.Column("busy", sa.Boolean, nullable=False),
        sa.Column("points", sa.Integer, nullable=False),
        *[sa.Column(name, sa.Float) for name in ("mae", "mase", "wql", "coverage_q90", "spike_recall")],
        sa.Column("spikes", sa.Integer, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("backtest_results")
    op.drop_table("backtest_runs")
