"""An in-memory view of the newest forecast run per model, for the autoscaler-facing reads.

Autoscalers poll every model every few seconds (KEDA: every 30 s per
ScaledObject), so 10,000 models make hundreds of requests a second that all ask
the same thing until the next forecast run lands, once a minute. The snapshot
reads only runs newer than the last one it saw, keeps each model's newest run,
and answers from memory; when the database is unreachable it keeps answering
from what it holds, and says the answer is stale.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

import numpy as np
from sqlalchemy import Engine, text
from sqlalchemy.exc import OperationalError

from forecaster.planning.recommendation import MinuteQuantiles
from forecaster.store.forecasts import read_newest_runs

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
    """Each model's newest run issued after ``since`` (all models' newest without it), streamed with COPY."""
    runs = read_newest_runs(conn, issued_after=since)
    out = {}
    minutes_all = runs.target_minutes_s()
    for i, model_id in enumerate(runs.model_ids):
        lo, hi = runs.offsets[i], runs.offsets[i + 1]
        point = runs.point[lo:hi]
        known = ~np.isnan(point)
        levels = runs.levels[i]
        keep = [j for j, level in enumerate(levels) if 0.0 < level < 1.0]
        values = runs.quantiles(i)[:, keep] if len(keep) < len(levels) else runs.quantiles(i)
        if not known.all():  # NULL elements (runs converted from the row layout with gaps): no forecast there
            point, values = point[known], values[known]
        out[model_id] = MinuteQuantiles(
            issued_at=datetime.fromtimestamp(runs.issued_at_s[i], tz=timezone.utc),
            model_version_id=runs.model_version_ids[i],
            minutes_s=minutes_all[lo:hi][known], levels=tuple(levels[j] for j in keep), values=values, point=point)
    return out
