"""Each forecast run keeps its model's request rate over the history it was made from (``request_rate_rpm``).

The plan step's default cold-cost weighting (``PREWARM_PLANNER_COLD_COST_WEIGHTING=model``) scales each model's
cold cost by the fleet's mean request rate over its own, so that every model's share of cold-start requests weighs
alike. The forecast job has each model's look-back in memory when it forecasts; it stores the rate with the run
(:func:`forecaster.contracts.forecast.history_request_rate_rpm`) and the plan job reads it with the run, so the plan
job never scans the invocation history for it. Nullable, no default: adding it rewrites nothing (on the partitioned
table it reaches every partition); runs written before it read as "rate not known" (weight 1).

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-07
"""

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import REAL

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("forecasts", sa.Column("request_rate_rpm", REAL, nullable=True))


def downgrade() -> None:
    op.drop_column("forecasts", "request_rate_rpm")
