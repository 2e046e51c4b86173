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
from datetime import datetime

import pandas as pd
from sqlalchemy import Engine, text
from sqlalchemy.exc import OperationalError

from forecaster.store.forecasts import StoredForecast

log = logging.getLogger(__name__)


@dataclass
class ModelView:
    replica_rps: float | None = None
    lead_time_s: float | None = None
    forecast: StoredForecast | None = None


@dataclass
class ForecastSnapshot:
    """Newest forecast per model plus what a recommendation needs (replica_rps, observed lead time)."""

    engine: Engine
    refresh_s: float = 2.0
    models: dict[str, ModelView] = field(default_factory=dict)
    newest_issued_at: datetime | None = None
    healthy: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _last_refresh: float = 0.0

    def refresh(self) -> bool:
        """Load catalogue changes and forecast runs newer than the newest seen. False if the database is away."""
        try:
            with self.engine.connect() as conn:
                catalogue = conn.execute(text(
                    "SELECT m.id, m.replica_rps, (SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY total_seconds) "
                    "FROM (SELECT total_seconds FROM cold_starts c WHERE c.model_id = m.id "
                    "ORDER BY started_at DESC LIMIT 20) AS recent) FROM serving_models m")).all()
                rows = conn.execute(
                    text("SELECT model_id, issued_at, target_minute, point, p_any, quantiles, model_version_id "
                         "FROM forecasts WHERE CAST(:since AS timestamptz) IS NULL OR issued_at > :since "
                         "ORDER BY model_id, issued_at, target_minute"),
                    {"since": self.newest_issued_at},
                ).all()
        except OperationalError as exc:
            self.healthy = False
            log.warning("forecast snapshot: database unavailable, serving what is held: %s", exc.orig)
            return False
        runs: dict[str, list] = {}
        for row in rows:
            model_rows = runs.setdefault(row[0], [])
            if model_rows and model_rows[0][1] != row[1]:
                model_rows.clear()  # a newer run of the same model: keep only the newest
            model_rows.append(row)
        with self._lock:
            known = {}
            for model_id, replica_rps, lead in catalogue:
                view = self.models.get(model_id) or ModelView()
                view.replica_rps, view.lead_time_s = replica_rps, lead
                known[model_id] = view
            for model_id, model_rows in runs.items():
                if model_id in known:
                    known[model_id].forecast = _as_forecast(model_id, model_rows)
            self.models = known
            if rows:
                newest = max(r[1] for r in rows)
                self.newest_issued_at = max(newest, self.newest_issued_at or newest)
        self.healthy = True
        self._last_refresh = time.monotonic()
        return True

    def refresh_if_due(self) -> None:
        if time.monotonic() - self._last_refresh >= self.refresh_s:
            self.refresh()

    def get(self, model_id: str) -> ModelView | None:
        with self._lock:
            return self.models.get(model_id)


def _as_forecast(model_id: str, rows: list) -> StoredForecast:
    frame = pd.DataFrame({"target_minute": [r[2] for r in rows], "point": [r[3] for r in rows],
                          "p_any": [r[4] for r in rows]})
    for level in sorted({k for r in rows for k in r[5]}, key=float):
        frame[f"q{level}"] = [r[5].get(level) for r in rows]
    return StoredForecast(model_id=model_id, issued_at=rows[0][1], model_version_id=rows[0][6], frame=frame)
