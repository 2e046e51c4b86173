"""Roll-ups of old invocation days: which day holds which step, and when it was rolled.

``forecaster.store.retention`` turns a whole daily partition of
``invocations`` into 5-minute, later hourly, buckets and records the day here;
ingest reads this table to refuse counts finer than the step a day now keeps.

No new index on ``invocations``: its primary key ``(model_id, minute)`` is
created on every partition (a rolled-up partition gets it before it is
attached), and the forecast job's read of the last day is served by partition
pruning on ``minute`` (two partitions scanned, the rest never opened). A GiST
index on ``coverage.ranges`` would speed the roll-up's coverage rewrite, but
every ingest updates ~one coverage row per model; the index would cost those
updates their HOT path for a job that runs once an hour, so there is none.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30
"""

from alembic import op
import sqlalchemy as sa

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "rollups",
        sa.Column("day", sa.Date, primary_key=True),
        sa.Column("step_seconds", sa.Integer, nullable=False),
        sa.Column("rolled_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.Column("rows_before", sa.BigInteger, nullable=False),
        sa.Column("rows_after", sa.BigInteger, nullable=False),
        sa.CheckConstraint("step_seconds > 0 AND step_seconds % 60 = 0 AND 86400 % step_seconds = 0",
                           name="rollups_step_divides_day"),
        sa.CheckConstraint("rows_after <= rows_before", name="rollups_rows_shrink"),
    )


def downgrade() -> None:
    op.drop_table("rollups")
