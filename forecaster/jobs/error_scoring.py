"""The forecast_errors job: score each target hour's forecast errors once, into the rollup the dashboard reads.

Every minute it asks the store which hours are due (:func:`forecaster.store.forecast_errors.hours_due`):
hours that ended ``PREWARM_ERROR_ROLLUP_DELAY_S`` ago and were never scored, were scored for other horizons,
or were touched by a count batch after their scoring (late or corrected counts). It scores them newest
first, at most :data:`MAX_HOURS_PER_RUN` per run (a first start catches up over a few runs), at the horizons
the dashboard offers (:func:`forecaster.store.dashboard.offered_horizons_min`), and drops hours older than
``PREWARM_ERROR_ROLLUP_RETENTION_DAYS``. Scoring an hour again replaces it, so a rerun never double counts.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import Engine

from forecaster.settings import Settings
from forecaster.store.dashboard import offered_horizons_min, stored_horizon_min
from forecaster.store.forecast_errors import drop_hours_before, floor_hour, hours_due, score_hour

#: Hours scored per run at most (about 40 s each at 100,000 models on two busy cores; see bench/dashboard.py).
MAX_HOURS_PER_RUN = 3


def score_errors_job(engine: Engine, settings: Settings, now: datetime, *,
                     max_hours: int = MAX_HOURS_PER_RUN) -> dict:
    """Score the due hours (newest first) and drop expired ones; returns what was done."""
    with engine.begin() as conn:
        _, horizons = offered_horizons_min(stored_horizon_min(conn), settings.forecast_horizon_min)
        dropped = drop_hours_before(conn, before=floor_hour(now) - timedelta(days=settings.error_rollup_retention_days))
        due = hours_due(conn, now=now, delay_s=settings.error_rollup_delay_s,
                        lookback_h=settings.error_rollup_lookback_h, horizons_min=horizons, limit=max_hours)
    scored = [score_hour(engine, hour=hour, horizons_min=horizons) for hour in due]
    return {"horizons_min": horizons, "dropped_hours": dropped,
            "scored": [{"hour": s.hour.isoformat(), "models": s.models, "rows": s.rows, "runs_read": s.runs_read,
                        "seconds": round(s.seconds, 3)} for s in scored]}
