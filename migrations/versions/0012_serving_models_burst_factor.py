"""Serving models' burst factor: how requests arrive inside a minute, for sizing replicas.

``serving_models.burst_factor`` (nullable): a minute's peak 10-second request rate over its mean, smoothed over
busy minutes (``forecaster.contracts.bursts``). Users declare it with ``PUT /v1/models/{id}``. Ingesting a
per-request trace measures it from the timestamps. The plan job divides a replica's capacity by it, and a model
without one is planned as if its arrivals were even (1). It lies between 1 (even arrivals) and 6 (every request
of a minute in one 10-second bucket).

Adding a nullable column without a default changes only the catalogue of the table, so there is no rewrite and
only a short lock.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-04
"""

from alembic import op
import sqlalchemy as sa

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

# Copied from forecaster.contracts.bursts.MAX_BURST_FACTOR (a migration is frozen once released).
MAX_BURST_FACTOR = 6.0


def upgrade() -> None:
    op.add_column("serving_models", sa.Column("burst_factor", sa.Float, nullable=True))
    op.create_check_constraint("serving_models_burst_factor_range", "serving_models",
                               f"burst_factor >= 1 AND burst_factor <= {MAX_BURST_FACTOR}")


def downgrade() -> None:
    op.drop_constraint("serving_models_burst_factor_range", "serving_models", type_="check")
    op.drop_column("serving_models", "burst_factor")
