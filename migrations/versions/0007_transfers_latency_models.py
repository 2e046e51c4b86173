"""Transfers the node agents perform (pre-pulls, pre-loads) as their own kind; latency models in the registry.

``transfers``: one row per pre-pull or pre-load a node agent actually carried
out (not a no-op): what moved (``ref``, ``bytes``), where (``node_id``, ``tier``),
when (``started_at``) and how long it took in total (``seconds``) and per phase
where the agent measured it (``image_pull_s``, ``weight_fetch_s``,
``weight_load_s``). They used to be stored as cold starts with state ``none``,
which made the latency model and the dashboard count work prewarm did ahead of
time as replicas that started cold. The key ``(model_id, node_id, kind,
started_at)`` makes a re-sent observation an update, not a second row.

Agent observations already stored as cold starts (``source = 'actuator-agent'``)
move to ``transfers``: a pre-pull where ``image_pull_s`` is set, else a
pre-load (tier ``disk``, which the old rows did not record), ``ref`` from the
catalogue, ``bytes`` unknown (NULL: the latency model learns no rate from a
transfer without its size, rather than one from the catalogue's guess).
Downgrading moves them back.

``model_versions.kind``: ``forecast`` (the ensemble, as before) or ``latency``
(the cold-start latency model); at most one champion per kind.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

from alembic import op
import sqlalchemy as sa

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

TZ = sa.DateTime(timezone=True)
PHASES = ("image_pull_s", "weight_fetch_s", "weight_load_s")


def upgrade() -> None:
    op.create_table(
        "transfers",
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
        sa.Column("model_id", sa.String(256), sa.ForeignKey("serving_models.id", ondelete="CASCADE"),
                  nullable=False),
        sa.Column("node_id", sa.String(256), nullable=False),
        sa.Column("kind", sa.String(16), sa.CheckConstraint("kind IN ('prepull', 'preload')"), nullable=False),
        sa.Column("tier", sa.String(16), sa.CheckConstraint("tier IN ('image', 'disk', 'host', 'gpu')"),
                  nullable=False),
        sa.Column("ref", sa.Text, nullable=False),
        sa.Column("bytes", sa.BigInteger, sa.CheckConstraint("bytes >= 0")),
        sa.Column("started_at", TZ, nullable=False),
        sa.Column("seconds", sa.Float, sa.CheckConstraint("seconds >= 0"), nullable=False),
        *[sa.Column(phase, sa.Float, sa.CheckConstraint(f"{phase} >= 0")) for phase in PHASES],
        sa.Column("cache_state", sa.String(32)),
        sa.Column("source", sa.String(128), nullable=False),
        sa.Column("created_at", TZ, server_default=sa.func.now(), nullable=False),
        sa.CheckConstraint("(kind = 'prepull') = (tier = 'image')", name="transfers_tier_matches_kind"),
        sa.UniqueConstraint("model_id", "node_id", "kind", "started_at", name="transfers_event_key"),
    )
    op.create_index("transfers_started_at", "transfers", ["started_at"])
    op.execute(
        "INSERT INTO transfers (model_id, node_id, kind, tier, ref, bytes, started_at, seconds, image_pull_s, "
        "weight_fetch_s, weight_load_s, cache_state, source) "
        "SELECT c.model_id, c.node_id, k.kind, CASE k.kind WHEN 'prepull' THEN 'image' ELSE 'disk' END, "
        "COALESCE(CASE k.kind WHEN 'prepull' THEN m.image_ref ELSE m.weights_uri END, 'unknown'), NULL, "
        "c.started_at, c.total_seconds, c.image_pull_s, c.weight_fetch_s, c.weight_load_s, c.cache_state, c.source "
        "FROM cold_starts c JOIN serving_models m ON m.id = c.model_id "
        "CROSS JOIN LATERAL (SELECT CASE WHEN c.image_pull_s IS NOT NULL THEN 'prepull' ELSE 'preload' END AS kind) k "
        "WHERE c.source = 'actuator-agent' "
        "ON CONFLICT ON CONSTRAINT transfers_event_key DO NOTHING")
    op.execute("DELETE FROM cold_starts WHERE source = 'actuator-agent'")

    op.add_column("model_versions", sa.Column("kind", sa.String(16), nullable=False, server_default="forecast"))
    op.create_check_constraint("model_versions_kind", "model_versions", "kind IN ('forecast', 'latency')")
    op.drop_index("model_versions_one_champion", table_name="model_versions")
    op.create_index("model_versions_one_champion", "model_versions", ["kind"], unique=True,
                    postgresql_where=sa.text("status = 'champion'"))


def downgrade() -> None:
    op.execute("DELETE FROM model_versions WHERE kind <> 'forecast'")
    op.drop_index("model_versions_one_champion", table_name="model_versions")
    op.create_index("model_versions_one_champion", "model_versions", ["status"], unique=True,
                    postgresql_where=sa.text("status = 'champion'"))
    op.drop_constraint("model_versions_kind", "model_versions", type_="check")
    op.drop_column("model_versions", "kind")
    op.execute(
        "INSERT INTO cold_starts (model_id, node_id, started_at, total_seconds, image_pull_s, weight_fetch_s, "
        "weight_load_s, cache_state, source) "
        "SELECT model_id, node_id, started_at, seconds, image_pull_s, weight_fetch_s, weight_load_s, cache_state, "
        "source FROM transfers ON CONFLICT ON CONSTRAINT cold_starts_event_key DO NOTHING")
    op.drop_index("transfers_started_at", table_name="transfers")
    op.drop_table("transfers")
