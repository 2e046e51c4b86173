"""Cold starts keyed by their event as well: ``cold_starts.event_id`` joins the ``cold_starts_event_key``.

The key was (model, node, start). Kubernetes stamps a pod's creation in whole seconds, so a scale-up by two that
puts both replicas on one 8-GPU node in the same second gave both the same key, and the collector, which keeps
the first observation of an event, stored one cold start of the two. The collector now sends the pod's uid as
``event_id``; a pushed event may send its own (say, a request or pod id). Events without one keep the old key
(``event_id`` is ''), so re-sending them stays harmless. The new column has a constant default (no table
rewrite); the unique index is rebuilt once.

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-07
"""

from alembic import op
import sqlalchemy as sa

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("cold_starts", sa.Column("event_id", sa.String(256), nullable=False, server_default=""))
    op.drop_constraint("cold_starts_event_key", "cold_starts", type_="unique")
    op.create_unique_constraint("cold_starts_event_key", "cold_starts",
                                ["model_id", "node_id", "started_at", "event_id"])


def downgrade() -> None:
    # Events that differ only in their id become one: keep the earliest stored.
    op.execute("DELETE FROM cold_starts c USING cold_starts d WHERE c.model_id = d.model_id "
               "AND c.node_id = d.node_id AND c.started_at = d.started_at AND c.id > d.id")
    op.drop_constraint("cold_starts_event_key", "cold_starts", type_="unique")
    op.create_unique_constraint("cold_starts_event_key", "cold_starts", ["model_id", "node_id", "started_at"])
    op.drop_column("cold_starts", "event_id")
