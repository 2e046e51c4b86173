"""Transfers the node agents carried out (pre-pulls, pre-loads): written idempotently, read for the latency model.

A transfer is work prewarm did ahead of demand; no replica waited on it, so it
is never a cold start. The key ``(model_id, node_id, kind, started_at)`` makes
a re-sent observation an update in place.
"""

from __future__ import annotations

from datetime import datetime

import pandas as pd
from sqlalchemy import Engine, text

from forecaster.store.catalog import require_models

#: Per-phase seconds a transfer may report (a subset of :data:`forecaster.contracts.phases.PHASES`).
TRANSFER_PHASES = ("image_pull_s", "weight_fetch_s", "weight_load_s")
TRANSFER_COLUMNS = ("model_id", "node_id", "kind", "tier", "ref", "bytes", "started_at", "seconds",
                    *TRANSFER_PHASES, "cache_state")


def write_transfers(engine: Engine, transfers: pd.DataFrame, *, source: str, register_models: bool = False) -> dict:
    """Insert validated transfers in one transaction; one already stored is updated, not duplicated.

    Args:
        transfers: rows as :func:`forecaster.ingest.transfers.validate_transfers` returns them.
        source: who reported them (``actuator-agent``, ``push`` ...).
        register_models: add unknown model ids to the catalogue instead of refusing the batch.

    Returns:
        ``{"inserted": n, "updated": m}``.
    """
    if transfers.empty:
        return {"inserted": 0, "updated": 0}
    columns = list(TRANSFER_COLUMNS)
    frame = transfers[columns]
    records = frame.astype(object).where(frame.notna(), None).to_dict("records")
    with engine.begin() as conn:
        require_models(conn, transfers["model_id"], register=register_models, source=source)
        placeholders = ", ".join(f":{c}" for c in columns)
        key = {"model_id", "node_id", "kind", "started_at"}
        updates = ", ".join(f"{c} = EXCLUDED.{c}" for c in columns if c not in key)
        stmt = text(
            f"INSERT INTO transfers ({', '.join(columns)}, source) VALUES ({placeholders}, :source) "
            f"ON CONFLICT ON CONSTRAINT transfers_event_key DO UPDATE SET {updates}, source = EXCLUDED.source "
            "RETURNING (xmax = 0) AS inserted")
        inserted = 0
        for record in records:
            inserted += bool(conn.execute(stmt, {**record, "source": source}).scalar_one())
    return {"inserted": inserted, "updated": len(records) - inserted}


def read_transfers(engine: Engine, *, since: datetime | None = None, days: float | None = None,
                   until: datetime | None = None, max_rows: int | None = None) -> pd.DataFrame:
    """Stored transfers (oldest first), with the node's reported bandwidth (``node_bytes_per_s``, bytes/s).

    Args:
        since: only transfers that started at or after this time (UTC); all when None.
        days: only those that started within ``days`` before the newest stored one, or before ``until`` where
            that is earlier; all when None.
        until: see ``days``.
        max_rows: at most this many, the newest (all when None).
    """
    query = text(
        "SELECT t.model_id, t.node_id, t.kind, t.tier, t.ref, t.bytes, t.started_at, t.seconds, "
        "t.image_pull_s, t.weight_fetch_s, t.weight_load_s, t.cache_state, t.source, "
        "n.network_bytes_per_s AS node_bytes_per_s "
        "FROM (SELECT * FROM transfers "
        "  WHERE (CAST(:since AS timestamptz) IS NULL OR started_at >= CAST(:since AS timestamptz)) "
        "  AND (CAST(:days AS float8) IS NULL OR started_at >= least((SELECT max(started_at) FROM transfers), "
        "       CAST(:until AS timestamptz)) - make_interval(secs => CAST(:days AS float8) * 86400)) "
        "  ORDER BY started_at DESC, id DESC LIMIT :limit) t LEFT JOIN nodes n ON n.id = t.node_id "
        "ORDER BY t.started_at, t.id")
    with engine.connect() as conn:
        rows = conn.execute(query, {"since": since, "days": days, "until": until, "limit": max_rows}
                            ).mappings().all()
    frame = pd.DataFrame(rows, columns=[*TRANSFER_COLUMNS, "source", "node_bytes_per_s"])
    for column in ("bytes", "seconds", *TRANSFER_PHASES, "node_bytes_per_s"):
        frame[column] = pd.to_numeric(frame[column], errors="coerce").astype("float64")
    return frame


def count_transfers(engine: Engine) -> int:
    """Rows in ``transfers`` (for job summaries and tests)."""
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM transfers")).scalar_one())
