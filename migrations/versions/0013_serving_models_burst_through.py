"""Serving models' burst watermark: the minutes that have moved the burst factor.

``serving_models.burst_through`` (nullable): the end of the newest minute whose count and 10-second peak moved
the model's burst factor (``forecaster.contracts.bursts``), from Prometheus' burst query or a pushed
``peak_10s``. The factor is a running average, so a minute must move it once: a minute that starts before the
watermark (a re-sent or corrected minute, or one that comes late) leaves the factor as it is.

A nullable column without a default: no rewrite, a short lock.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-04
"""

from alembic import op
import sqlalchemy as sa

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("serving_models", sa.Column("burst_through", sa.TIMESTAMP(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column("serving_models", "burst_through")
