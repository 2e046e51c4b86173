"""Forecast-error rollup: the sums behind ``p_any``'s Brier score, per model, horizon and target hour.

``forecast_errors`` gains, over the scored minutes whose run stored ``p_any`` (the probability of any invocation):
``p_any_minutes`` (how many), ``p_any_sq_error`` (the sum of ``(p_any - [actual > 0])^2``), ``p_any_sum`` and
``invoked_minutes`` (those with an invocation). They add up over hours like the other sums, so the fleet ranking
reads a window's Brier score, mean ``p_any`` and invoked share from the rollup.

Constant defaults: no table rewrite. The scored hours are forgotten (``forecast_error_hours`` emptied), so the
scoring job scores the hours within its lookback again with the new sums; until it has, the fleet page reads those
hours from the runs, as it does for any hour not yet scored.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-06
"""

from alembic import op
import sqlalchemy as sa

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

COLUMNS = (("p_any_minutes", sa.SmallInteger), ("p_any_sq_error", sa.Float), ("p_any_sum", sa.Float),
           ("invoked_minutes", sa.SmallInteger))


def upgrade() -> None:
    for name, kind in COLUMNS:
        op.add_column("forecast_errors", sa.Column(name, kind, nullable=False, server_default="0"))
    op.execute("DELETE FROM forecast_error_hours")


def downgrade() -> None:
    for name, _ in reversed(COLUMNS):
        op.drop_column("forecast_errors", name)
