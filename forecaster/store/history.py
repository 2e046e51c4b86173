"""What the advisory report (``prewarm report``) reads besides the counts: the span of stored data, the catalogue
rows as plain tuples, and the shape of the registered nodes.

The counts themselves come from :func:`forecaster.store.invocations.read_grid` (NaN = unknown, 0 = known zero).
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Connection, Engine, text

CATALOGUE_COLUMNS = ("model_id", "image_ref", "image_bytes", "weights_uri", "weights_bytes", "gpus", "replica_rps",
                     "cold_start_slo_s", "labels")


def _run(engine: Engine | Connection, statement, params: dict):
    if isinstance(engine, Connection):
        return engine.execute(statement, params).all()
    with engine.connect() as conn:
        return conn.execute(statement, params).all()


def stored_span(engine: Engine | Connection, model_ids: list[str] | None = None, *,
                step_seconds: int = 60) -> tuple[datetime | None, datetime | None]:
    """``(earliest start, latest end)`` of the coverage at ``step_seconds`` (of ``model_ids``; None: every model);
    ``(None, None)`` when nothing is covered."""
    rows = _run(engine, text(
        "SELECT min(lower(ranges)), max(upper(ranges)) FROM coverage WHERE step_seconds = :step "
        "AND (CAST(:ids AS text[]) IS NULL OR model_id = ANY(CAST(:ids AS text[])))"),
        {"step": step_seconds, "ids": None if model_ids is None else sorted(set(model_ids))})
    return (rows[0][0], rows[0][1]) if rows else (None, None)


def read_catalogue(engine: Engine | Connection) -> list[tuple]:
    """Every catalogue row as :data:`CATALOGUE_COLUMNS`, ordered by id."""
    return _run(engine, text(
        "SELECT id, image_ref, image_size_bytes, weights_uri, weights_size_bytes, gpus_per_replica, replica_rps, "
        "cold_start_slo_s, labels FROM serving_models ORDER BY id"), {})


def node_shapes(engine: Engine | Connection) -> list[tuple]:
    """``(id, gpus_total, disk_free_bytes, host_memory_free_bytes)`` of every registered node, ordered by id."""
    return _run(engine, text(
        "SELECT id, gpus_total, disk_free_bytes, host_memory_free_bytes FROM nodes ORDER BY id"), {})
