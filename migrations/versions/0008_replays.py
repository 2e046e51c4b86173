"""Replays of a trace on a simulated cluster (``prewarm demo``) and their per-model outcome per policy.

A replay drives prewarm's real loop (stored forecasts, the plan job, the actuator) onto a fleet simulator, and
a reactive autoscaler on the same minutes onto a second one; ``replay_outcomes`` keeps, per model and policy,
what the simulator measured so far, so the dashboard can show cold starts avoided and wait saved.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "replays",
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
        sa.Column("source", sa.String(64), nullable=False),
        sa.Column("window_start", sa.DateTime(timezone=True), nullable=False),
        sa.Column("window_end", sa.DateTime(timezone=True), nullable=False),
        sa.Column("scored_until", sa.DateTime(timezone=True), nullable=False),
        sa.Column("policies", postgresql.JSONB, nullable=False),
        sa.Column("summary", postgresql.JSONB, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.CheckConstraint("window_start < window_end", name="replays_window_order"),
    )
    op.create_table(
        "replay_outcomes",
        sa.Column("replay_id", sa.BigInteger, sa.ForeignKey("replays.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("policy", sa.String(64), primary_key=True),
        sa.Column("model_id", sa.String(256), primary_key=True),
        sa.Column("requests", sa.BigInteger, nullable=False),
        sa.Column("cold_requests", sa.BigInteger, nullable=False),
        sa.Column("replica_starts", sa.Integer, nullable=False),
        sa.Column("wait_total_s", sa.Float, nullable=False),
        sa.Column("wait_max_s", sa.Float, nullable=False),
        sa.CheckConstraint("cold_requests >= 0 AND cold_requests <= requests", name="replay_outcomes_cold_bound"),
    )


def downgrade() -> None:
    op.drop_table("replay_outcomes")
    op.drop_table("replays")
