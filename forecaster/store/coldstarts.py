"""Writing observed cold starts; the (model, node, start, event id) key makes re-sends harmless (an update, or
kept)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import pandas as pd
from sqlalchemy import Engine, text

from forecaster.contracts.phases import PHASES
from forecaster.store.catalog import require_models


def write_cold_starts(engine: Engine, events: pd.DataFrame, *, source: str, register_models: bool = False,
                      keep_stored: bool = False) -> dict:
    """Insert validated events in one transaction; an event already stored is updated, not duplicated.

    Args:
        keep_stored: the first observation of an event wins: one already stored is left as it is (the actuator's
            collector, which sees a pod again on every run, and after a restart with a later Ready time); without
            it a re-sent event updates the stored one (the REST push: a sender corrects what it sent).

    Returns:
        ``{"inserted": n, "updated": m}``; with ``keep_stored``, ``{"inserted": n, "already_stored": m}``.
    """
    if events.empty:
        return {"inserted": 0, "already_stored" if keep_stored else "updated": 0}
    if "event_id" not in events.columns:
        events = events.assign(event_id="")
    events = events.assign(event_id=events["event_id"].fillna("").astype(str))
    columns = ["model_id", "node_id", "started_at", "event_id", "total_seconds", *PHASES, "cache_state"]
    records = events[columns].astype(object).where(events[columns].notna(), None).to_dict("records")
    with engine.begin() as conn:
        require_models(conn, events["model_id"], register=register_models, source=source)
        placeholders = ", ".join(f":{c}" for c in columns)
        updates = ", ".join(f"{c} = EXCLUDED.{c}" for c in columns[4:])
        insert = f"INSERT INTO cold_starts ({', '.join(columns)}, source) VALUES ({placeholders}, :source) "
        if keep_stored:
            stmt = text(insert + "ON CONFLICT ON CONSTRAINT cold_starts_event_key DO NOTHING RETURNING true")
            inserted = sum(conn.execute(stmt, {**record, "source": source}).first() is not None
                           for record in records)
            return {"inserted": inserted, "already_stored": len(records) - inserted}
        stmt = text(
            insert + f"ON CONFLICT ON CONSTRAINT cold_starts_event_key DO UPDATE SET {updates}, "
            "source = EXCLUDED.source RETURNING (xmax = 0) AS inserted"
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


#: How many of a model's newest stored cold starts its observed rolling figures cover (the dashboard's median too).
RECENT_COLD_STARTS = 20


def recent_cold_start_percentiles(conn, *, model_ids: list[str], quantile: float = 0.9,
                                  last_n: int = RECENT_COLD_STARTS, by_cache_state: bool = False) -> pd.DataFrame:
    """The ``quantile`` of total seconds over each model's ``last_n`` newest stored cold starts, in one query.

    Args:
        model_ids: the models to answer for; a model without stored cold starts gets no row.
        quantile: in [0, 1] (0.9: the rolling p90); interpolated between starts (``percentile_cont``).
        by_cache_state: one row per (model, ``cache_state``) over the ``last_n`` newest starts from that state
            (states never observed get no row; an unreported state is ``unknown``).

    Returns:
        ``model_id, [cache_state,] seconds, n`` (``n``: how many starts the figure covers, at most ``last_n``).
    """
    columns = ["model_id", *(["cache_state"] if by_cache_state else []), "seconds", "n"]
    if not model_ids:
        return pd.DataFrame(columns=columns)
    if by_cache_state:
        query = text(
            "SELECT model_id, cache_state, percentile_cont(:q) WITHIN GROUP (ORDER BY total_seconds) AS seconds, "
            "count(*) AS n FROM (SELECT model_id, coalesce(cache_state, 'unknown') AS cache_state, total_seconds, "
            "row_number() OVER (PARTITION BY model_id, coalesce(cache_state, 'unknown') "
            "ORDER BY started_at DESC, id DESC) AS age FROM cold_starts WHERE model_id = ANY(:ids)) AS ranked "
            "WHERE age <= :n GROUP BY model_id, cache_state ORDER BY model_id, cache_state")
    else:  # one index walk (cold_starts_model_time) per model, newest first
        query = text(
            "SELECT m.id AS model_id, percentile_cont(:q) WITHIN GROUP (ORDER BY r.total_seconds) AS seconds, "
            "count(*) AS n FROM unnest(CAST(:ids AS text[])) AS m(id) CROSS JOIN LATERAL ("
            "SELECT total_seconds FROM cold_starts c WHERE c.model_id = m.id "
            "ORDER BY c.started_at DESC, c.id DESC LIMIT :n) AS r GROUP BY m.id ORDER BY m.id")
    rows = conn.execute(query, {"q": float(quantile), "ids": list(model_ids), "n": int(last_n)}).all()
    return pd.DataFrame([tuple(r) for r in rows], columns=columns)


def read_cold_start_events(engine: Engine, *, days: float | None = None, max_events: int | None = None,
                           until: datetime | None = None, conn=None) -> pd.DataFrame:
    """Stored cold starts (oldest first) with the model's sizes and the node's bandwidth, for the latency model.

    Args:
        days: only those that started within ``days`` before the newest stored one, or before ``until`` where
            that is earlier (a row dated in the year 9999 does not empty the window); all when None.
        max_events: at most this many, the newest (all when None).
        until: see ``days``.
        conn: read on this connection (a training reads in the snapshot of its watermark,
            :func:`cold_start_training_watermark`); else on one of ``engine``'s.

    Columns: ``model_id, node_id, started_at, total_seconds``, the phases,
    ``cache_state``, ``image_bytes`` and ``weights_bytes`` (from
    ``serving_models``, 0 when unknown) and ``node_bytes_per_s`` (from
    ``nodes``; NaN when the node never reported one). Rows are returned as
    stored: the latency model skips (and counts) the ones it cannot use.
    """
    columns = ["model_id", "node_id", "started_at", "total_seconds", *PHASES, "cache_state", "image_bytes",
               "weights_bytes", "node_bytes_per_s"]
    query = text(  # the newest first through cold_starts_time_model, then oldest first for the fit
        "SELECT c.model_id, c.node_id, c.started_at, c.total_seconds, c.image_pull_s, c.weight_fetch_s, "
        "c.weight_load_s, c.runtime_init_s, c.registration_s, c.cache_state, "
        "COALESCE(m.image_size_bytes, 0) AS image_bytes, COALESCE(m.weights_size_bytes, 0) AS weights_bytes, "
        "n.network_bytes_per_s AS node_bytes_per_s "
        "FROM (SELECT * FROM cold_starts WHERE CAST(:days AS float8) IS NULL OR started_at >= "
        "  least((SELECT max(started_at) FROM cold_starts), CAST(:until AS timestamptz)) "
        "  - make_interval(secs => CAST(:days AS float8) * 86400) "
        "  ORDER BY started_at DESC, id DESC LIMIT :limit) c "
        "JOIN serving_models m ON m.id = c.model_id LEFT JOIN nodes n ON n.id = c.node_id "
        "ORDER BY c.started_at, c.id")
    params = {"days": days, "limit": max_events, "until": until}
    if conn is not None:
        return pd.DataFrame(conn.execute(query, params).mappings().all(), columns=columns)
    with engine.connect() as own:
        return pd.DataFrame(own.execute(query, params).mappings().all(), columns=columns)


#: How many of the highest ids below a training's watermark :func:`cold_start_training_watermark` checks for gaps
#: (ids not visible to the training: inserted by a transaction still open then, or rolled back, or deleted). An
#: identity id is taken at insert and seen at commit, so a row with a lower id than the watermark can commit after
#: the training read it; a transaction that held its id while this many later ones were stored is not covered.
GAP_SPAN = 100_000
#: The most gap ids a training records; over it (a large rollback or deletion within the span) the observation
#: reads every row of the span again and drops those the model already holds, by key.
MAX_GAPS = 10_000


@dataclass(frozen=True)
class TrainingWatermark:
    """What a latency model was trained through: every row with ``id <= through_id`` that its snapshot could see,
    except the ``gap_ids`` (ids in ``(floor_id, through_id]`` that it could not: observed later, when they commit).
    ``gap_ids`` None: more than :data:`MAX_GAPS`; every row of ``(floor_id, through_id]`` is read again and
    de-duplicated by key (:func:`forecaster.coldstart.service._observed`)."""

    through_id: int
    floor_id: int
    gap_ids: tuple[int, ...] | None


def cold_start_training_watermark(conn, *, span: int | None = None, max_gaps: int | None = None
                                  ) -> TrainingWatermark:
    """The highest ``cold_starts.id`` ``conn``'s snapshot sees (0 when none) and the ids below it, within ``span``,
    that it does not see. Read it in the transaction (REPEATABLE READ) that reads the training's rows: the two
    then describe the same snapshot. Two index scans of at most ``span`` entries (an index-only count, then the
    gaps' edges where there are few enough). ``span``/``max_gaps``: default :data:`GAP_SPAN`/:data:`MAX_GAPS`."""
    span = GAP_SPAN if span is None else span
    max_gaps = MAX_GAPS if max_gaps is None else max_gaps
    through = int(conn.execute(text("SELECT coalesce(max(id), 0) FROM cold_starts")).scalar_one())
    floor = max(0, through - int(span))
    present = int(conn.execute(text("SELECT count(*) FROM cold_starts WHERE id > :floor"),
                               {"floor": floor}).scalar_one())
    missing = through - floor - present
    if missing > max_gaps:
        return TrainingWatermark(through, floor, None)
    gaps: list[int] = []
    if missing:
        edges = conn.execute(text(
            "SELECT prev, id FROM (SELECT id, lag(id, 1, CAST(:floor AS bigint)) OVER (ORDER BY id) AS prev "
            "FROM cold_starts WHERE id > :floor) AS ids WHERE id > prev + 1"), {"floor": floor}).all()
        for prev, nxt in edges:
            gaps.extend(range(int(prev) + 1, int(nxt)))
    return TrainingWatermark(through, floor, tuple(gaps))


def count_cold_starts(engine: Engine) -> int:
    """How many cold starts are stored (one ``count(*)``)."""
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM cold_starts")).scalar_one())


def cold_starts_after_summary(engine: Engine, *, after_id: int, started_before: datetime,
                              also_ids: tuple[int, ...] | list[int] = ()) -> tuple[int, int]:
    """(count, highest id) of the cold starts stored with ``id > after_id`` (or an id of ``also_ids``: a
    training's gaps) that started before ``started_before``: one range scan of the primary key (and a probe per
    gap id) over what arrived since a model's training."""
    with engine.connect() as conn:
        row = conn.execute(text("SELECT count(*), coalesce(max(id), 0) FROM cold_starts WHERE "
                                "(id > :after OR id = ANY(CAST(:also AS bigint[]))) AND started_at < :before"),
                           {"after": int(after_id), "before": started_before,
                            "also": [int(i) for i in also_ids]}).one()
    return int(row[0]), int(row[1])


def read_cold_starts_after(engine: Engine, *, after_id: int, started_before: datetime,
                           also_ids: tuple[int, ...] | list[int] = ()) -> pd.DataFrame:
    """The cold starts stored with ``id > after_id`` (or an id of ``also_ids``) that started before
    ``started_before`` (oldest first), in :func:`read_cold_start_events`' columns: what a loaded latency model
    observes between its refits."""
    columns = ["model_id", "node_id", "started_at", "total_seconds", *PHASES, "cache_state", "image_bytes",
               "weights_bytes", "node_bytes_per_s"]
    query = text(
        "SELECT c.model_id, c.node_id, c.started_at, c.total_seconds, c.image_pull_s, c.weight_fetch_s, "
        "c.weight_load_s, c.runtime_init_s, c.registration_s, c.cache_state, "
        "COALESCE(m.image_size_bytes, 0) AS image_bytes, COALESCE(m.weights_size_bytes, 0) AS weights_bytes, "
        "n.network_bytes_per_s AS node_bytes_per_s "
        "FROM cold_starts c JOIN serving_models m ON m.id = c.model_id LEFT JOIN nodes n ON n.id = c.node_id "
        "WHERE (c.id > :after OR c.id = ANY(CAST(:also AS bigint[]))) AND c.started_at < :before "
        "ORDER BY c.started_at, c.id")
    params = {"after": int(after_id), "before": started_before, "also": [int(i) for i in also_ids]}
    with engine.connect() as conn:
        return pd.DataFrame(conn.execute(query, params).mappings().all(), columns=columns)
