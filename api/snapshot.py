"""An in-memory view of the newest forecast run per model, for the autoscaler-facing reads.

Autoscalers poll every model every few seconds (KEDA: every 30 s per
ScaledObject), so 10,000 models make hundreds of requests a second that all ask
the same thing until the next forecast run lands, once a minute. The snapshot
reads only runs newer than the last one it saw, keeps each model's newest run,
and answers from memory; when the database is unreachable it keeps answering
from what it holds, and says the answer is stale.
"""

from __future__ import annotations

import io
import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

import numpy as np
import pandas as pd
from sqlalchemy import Engine, text
from sqlalchemy.exc import OperationalError

from forecaster.planning.recommendation import MinuteQuantiles

log = logging.getLogger(__name__)


@dataclass
class ModelView:
    replica_rps: float | None = None
    lead_time_s: float | None = None
    forecast: MinuteQuantiles | None = None


@dataclass
class ForecastSnapshot:
    """Newest forecast per model plus what a recommendation needs (replica_rps, observed lead time)."""

    engine: Engine
    refresh_s: float = 2.0
    models: dict[str, ModelView] = field(default_factory=dict)
    newest_issued_at: datetime | None = None
    healthy: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _refreshing: threading.Lock = field(default_factory=threading.Lock)
    _last_refresh: float = 0.0

    def refresh(self) -> bool:
        """Load catalogue changes and forecast runs newer than the newest seen. False if the database is away.

        Single-flight: while one refresh runs, another caller returns at once with what is held.
        """
        if not self._refreshing.acquire(blocking=False):
            return self.healthy
        try:
            return self._refresh()
        finally:
            self._refreshing.release()

    def _refresh(self) -> bool:
        try:
            with self.engine.connect() as conn:
                catalogue = conn.execute(text(
                    "SELECT m.id, m.replica_rps, lead.seconds FROM serving_models m LEFT JOIN LATERAL ("
                    "  SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY total_seconds) AS seconds FROM ("
                    "    SELECT total_seconds FROM cold_starts c WHERE c.model_id = m.id "
                    "    ORDER BY started_at DESC LIMIT 20) AS recent) AS lead ON true")).all()
                runs = _newer_runs(conn, self.newest_issued_at)
        except OperationalError as exc:
            self.healthy = False
            log.warning("forecast snapshot: database unavailable, serving what is held: %s", exc.orig)
            return False
        with self._lock:
            known = {}
            for model_id, replica_rps, lead in catalogue:
                view = self.models.get(model_id) or ModelView()
                view.replica_rps, view.lead_time_s = replica_rps, lead
                known[model_id] = view
            newest = self.newest_issued_at
            for model_id, run in runs.items():
                if model_id in known:
                    known[model_id].forecast = run
                newest = run.issued_at if newest is None else max(newest, run.issued_at)
            self.models = known
            self.newest_issued_at = newest
        self.healthy = True
        self._last_refresh = time.monotonic()
        return True

    def refresh_if_due(self) -> None:
        if time.monotonic() - self._last_refresh >= self.refresh_s:
            self.refresh()

    def get(self, model_id: str) -> ModelView | None:
        with self._lock:
            return self.models.get(model_id)


def _newer_runs(conn, since: datetime | None) -> dict[str, MinuteQuantiles]:
    """Each model's newest run issued after ``since``, streamed with COPY into arrays."""
    bound = "issued_at > %(since)s" if since is not None else "true"
    levels = [row[0] for row in conn.exec_driver_sql(
        "SELECT DISTINCT jsonb_object_keys(quantiles) FROM (SELECT quantiles FROM forecasts "
        f"WHERE {bound} LIMIT 1000) AS sample", {"since": since} if since is not None else {}).all()]
    levels = sorted(levels, key=float)
    quantile_sql = "".join(f", (f.quantiles->>'{lvl}')::float8" for lvl in levels if _is_level(lvl))
    levels = [lvl for lvl in levels if _is_level(lvl)]
    query = (
        "COPY (SELECT f.model_id, extract(epoch FROM f.issued_at), extract(epoch FROM f.target_minute)::bigint, "
        f"coalesce(f.model_version_id, ''), f.point{quantile_sql} FROM forecasts f "
        "JOIN (SELECT model_id, max(issued_at) AS issued_at FROM forecasts "
        f"      WHERE {bound} GROUP BY model_id) newest USING (model_id, issued_at) "
        "ORDER BY f.model_id, f.target_minute) TO STDOUT"
    )
    buffer = io.BytesIO()
    raw = conn.connection.driver_connection
    with raw.cursor() as cur, cur.copy(query, {"since": since} if since is not None else None) as copy:
        for block in copy:
            buffer.write(block)
    if not buffer.tell():
        return {}
    buffer.seek(0)
    frame = pd.read_csv(buffer, sep="\t", header=None, na_values=["\\N"], keep_default_na=False,
                        dtype={0: str, 3: str})
    ids = frame[0].to_numpy()
    bounds = np.flatnonzero(ids[1:] != ids[:-1]) + 1
    starts = np.concatenate([[0], bounds])
    ends = np.concatenate([bounds, [len(frame)]])
    issued = frame[1].to_numpy(dtype="float64")
    minutes = frame[2].to_numpy(dtype="int64")
    versions = frame[3].to_numpy()
    point = frame[4].to_numpy(dtype="float64")
    values = frame[list(range(5, 5 + len(levels)))].to_numpy(dtype="float64")
    level_values = tuple(float(lvl) for lvl in levels)
    runs = {}
    for lo, hi in zip(starts, ends):
        runs[ids[lo]] = MinuteQuantiles(
            issued_at=datetime.fromtimestamp(issued[lo], tz=timezone.utc),
            model_version_id=versions[lo] or None,
            minutes_s=minutes[lo:hi], levels=level_values, values=values[lo:hi], point=point[lo:hi])
    return runs


def _is_level(text_level: str) -> bool:
    try:
        return 0.0 < float(text_level) < 1.0
    except ValueError:
        return False
