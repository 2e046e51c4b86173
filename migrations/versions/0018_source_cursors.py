"""How far a pull source has asked for a model's minutes and found no sample (``source_cursors``).

The Prometheus ingest resumes each model at the end of its coverage. A model without any series (scaled to zero:
no pods, no samples) never extends its coverage, so every run asked Prometheus again for every minute since the
model was last served, up to ``PREWARM_PROMETHEUS_MAX_CATCH_UP_MINUTES`` (15 days): about 70 ms and three
10,000-step queries per idle model per run on the test Prometheus, so a long tail of 1,000 idle models took longer
than the minute between runs, and the oldest (idle) models were read first. ``asked_through`` records the end of
a run that found no sample for the model; the next run starts there. Minutes before it without a sample are gaps
that will not fill (the ingest's lag covers late scrapes). The cursor holds for the query it was asked with
(``query_sha256``): a corrected ``prometheus_query`` label or template asks again from the watermark. Rows go with
their model.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-07
"""

from alembic import op
import sqlalchemy as sa

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "source_cursors",
        sa.Column("model_id", sa.String(256), sa.ForeignKey("serving_models.id", ondelete="CASCADE"),
                  primary_key=True),
        sa.Column("source", sa.String(128), primary_key=True),
        sa.Column("asked_through", sa.DateTime(timezone=True), nullable=False),
        sa.Column("query_sha256", sa.String(64), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("source_cursors")
