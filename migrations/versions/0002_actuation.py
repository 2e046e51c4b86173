"""Actuation: action status detail, retry schedule, idempotency key; the actuator's kill switch.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

TZ = sa.DateTime(timezone=True)
STATUSES = "('pending', 'running', 'succeeded', 'failed', 'dropped')"


def upgrade() -> None:
    op.add_column("actions", sa.Column("key", sa.Text))
    op.add_column("actions", sa.Column("backend", sa.String(32)))
    op.add_column("actions", sa.Column("detail", postgresql.JSONB, nullable=False,
                                       server_default=sa.text("'{}'::jsonb")))
    op.add_column("actions", sa.Column("next_attempt_at", TZ))
    op.add_column("actions", sa.Column("started_at", TZ))
    op.add_column("actions", sa.Column("finished_at", TZ))
    op.add_column("actions", sa.Column("created_at", TZ, server_default=sa.func.now(), nullable=False))
    op.create_check_constraint("actions_status_known", "actions", f"status IN {STATUSES}")
    # One open (pending or running) unit of work per key: the same work asked twice is one unit.
    op.create_index("actions_open_key", "actions", ["key"], unique=True,
                    postgresql_where=sa.text("status IN ('pending', 'running')"))
    op.create_index("actions_started", "actions", ["started_at"])
    op.create_index("actions_model_kind", "actions", ["model_id", "kind", "finished_at"])

    op.create_table(
        "actuator_control",
        sa.Column("id", sa.SmallInteger, sa.CheckConstraint("id = 1", name="actuator_control_single_row"),
                  primary_key=True),
        sa.Column("paused", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("reason", sa.Text),
        sa.Column("updated_by", sa.String(128)),
        sa.Column("updated_at", TZ, server_default=sa.func.now(), nullable=False),
    )
    op.execute("INSERT INTO actuator_control (id, paused) VALUES (1, false)")


def downgrade() -> None:
    op.drop_table("actuator_control")
    op.drop_index("actions_model_kind", table_name="actions")
    op.drop_index("actions_started", table_name="actions")
    op.drop_index("actions_open_key", table_name="actions")
    op.drop_constraint("actions_status_known", "actions", type_="check")
    for column in ("created_at", "finished_at", "started_at", "next_attempt_at", "detail", "backend", "key"):
        op.drop_column("actions", column)
