"""Writing observed cold starts; the (model, node, start) key makes re-sends harmless."""

from __future__ import annotations

import pandas as pd
from sqlalchemy import Engine, text

from forecaster.contracts.phases import PHASES
from forecaster.store.catalog import require_models


def write_cold_starts(engine: Engine, events: pd.DataFrame, *, source: str, register_models: bool = False) -> dict:
    """Insert validated events in one transaction; an event already stored is updated, not duplicated.

    Returns:
        ``{"inserted": n, "updated": m}``.
    """
    if events.empty:
        return {"inserted": 0, "updated": 0}
    columns = ["model_id", "node_id", "started_at", "total_seconds", *PHASES, "cache_state"]
    records = events[columns].astype(object).where(events[columns].notna(), None).to_dict("records")
    with engine.begin() as conn:
        require_models(conn, events["model_id"], register=register_models, source=source)
        placeholders = ", ".join(f":{c}" for c in columns)
        updates = ", ".join(f"{c} = EXCLUDED.{c}" for c in columns[3:])
        stmt = text(
            f"INSERT INTO cold_starts ({', '.join(columns)}, source) VALUES ({placeholders}, :source) "
            f"ON CONFLICT ON CONSTRAINT cold_starts_event_key DO UPDATE SET {updates}, source = EXCLUDED.source "
            "RETURNING (xmax = 0) AS inserted"
        )
        inserted = 0
        for record in records:
            inserted += bool(conn.execute(stmt, {**record, "source": source}).scalar_one())
    return {"inserted": inserted, "updated": len(records) - inserted}


def recent_cold_start_seconds(conn, *, model_id: str, last_n: int = 20) -> float | None:
    """Median total cold-start seconds of the model's last ``last_n`` observed starts, or None."""
    return conn.execute(
        text("SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY total_seconds) FROM ("
             "SELECT total_seconds FROM cold_starts WHERE model_id = :m ORDER BY started_at DESC LIMIT :n) AS recent"),
        {"m": model_id, "n": last_n},
    ).scalar()


def read_cold_start_events(engine: Engine) -> pd.DataFrame:
    """Every stored cold start (oldest first) with the model's sizes and the node's bandwidth, for the latency model.

    Columns: ``model_id, node_id, started_at, total_seconds``, the phases,
    ``cache_state``, ``image_bytes`` and ``weights_bytes`` (from
    ``serving_models``, 0 when unknown) and ``node_bytes_per_s`` (from
    ``nodes``; NaN when the node never reported one). Rows are returned as
    stored: the latency model skips (and counts) the ones it cannot use.
    """
    columns = ["model_id", "node_id", "started_at", "total_seconds", *PHASES, "cache_state", "image_bytes",
               "weights_bytes", "node_bytes_per_s"]
    query = text(
        "SELECT c.model_id, c.node_id, c.started_at, c.total_seconds, c.image_pull_s, c.weight_fetch_s, "
        "c.weight_load_s, c.runtime_init_s, c.registration_s, c.cache_state, "
        "COALESCE(m.image_size_bytes, 0) AS image_bytes, COALESCE(m.weights_size_bytes, 0) AS weights_bytes, "
        "n.network_bytes_per_s AS node_bytes_per_s "
        "FROM cold_starts c JOIN serving_models m ON m.id = c.model_id LEFT JOIN nodes n ON n.id = c.node_id "
        "ORDER BY c.started_at, c.id")
    with engine.connect() as conn:
        return pd.DataFrame(conn.execute(query).mappings().all(), columns=columns)
