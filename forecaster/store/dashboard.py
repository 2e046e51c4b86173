"""Reads behind the dashboard: forecast vs actual per model, cold starts, the action timeline, the fleet ranking.

Horizon: a forecast row issued at ``issued_at`` for ``target_minute`` has
horizon ``ceil((target_minute - issued_at) / 1 min)`` minutes, i.e. the
target minute's distance from the minute the run was issued in (a run issued
at 12:00:30 for 12:05 has horizon 5; its first target minute, 12:00, has
horizon 0). Migration 0003 indexes ``forecasts`` on exactly this expression,
so reading "the forecast made h minutes ahead" for a week of target minutes
touches one index entry per minute instead of every run's 60.

Actual counts come from :func:`forecaster.store.invocations.read_counts`
semantics: a minute outside every source's coverage is unknown (NaN) and is
left out of every error figure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import numpy as np
from sqlalchemy import Connection, text

from forecaster.store.coldstarts import recent_cold_start_seconds
from forecaster.store.invocations import read_counts

#: Horizon of a forecast row in minutes; must match the expression indexed by migration 0003 word for word.
HORIZON_MIN_SQL = "CAST(ceil(EXTRACT(EPOCH FROM (target_minute - issued_at)) / 60) AS integer)"
#: When an action happens on the timeline (planned start, else its last status change); indexed by 0003.
ACTION_TIME_SQL = "coalesce(not_before, updated_at)"
#: Actions that began this long before a window still show in it when their deadline falls inside.
ACTION_LOOKBACK = timedelta(days=1)

MINUTE = timedelta(minutes=1)


def model_exists(conn: Connection, *, model_id: str) -> bool:
    return conn.execute(text("SELECT 1 FROM serving_models WHERE id = :m"), {"m": model_id}).first() is not None


@dataclass(frozen=True)
class ForecastError:
    """Forecast error over the minutes where both the forecast and the actual count are known.

    Attributes:
        scored_minutes: minutes that entered the figures.
        mae: mean absolute error (invocations per minute); None with no scored minute.
        wmape: sum of absolute errors over sum of actuals; None when the actuals sum to zero.
        band_coverage: share of scored minutes whose actual lies inside the widest stored quantile band.
    """

    scored_minutes: int
    mae: float | None
    wmape: float | None
    band_coverage: float | None = None


def forecast_error(actual: np.ndarray, point: np.ndarray, lo: np.ndarray | None = None,
                   hi: np.ndarray | None = None) -> ForecastError:
    """MAE, wMAPE and band coverage over the positions where ``actual`` and ``point`` are both known."""
    known = ~np.isnan(actual) & ~np.isnan(point)
    n = int(known.sum())
    if n == 0:
        return ForecastError(0, None, None, None)
    abs_err = np.abs(point[known] - actual[known])
    total = float(actual[known].sum())
    coverage = None
    if lo is not None and hi is not None:
        inside = (actual[known] >= lo[known]) & (actual[known] <= hi[known])
        coverage = float(inside.mean())
    return ForecastError(n, float(abs_err.mean()), float(abs_err.sum()) / total if total > 0 else None, coverage)


def _is_level(key: str) -> bool:
    try:
        return 0.0 < float(key) < 1.0
    except ValueError:
        return False


@dataclass(frozen=True)
class ForecastSeries:
    """One model's actual and forecast per minute over ``[start, end)`` at one horizon.

    Arrays are aligned on ``minutes`` (Unix seconds, one per minute); NaN marks
    an unknown actual or a minute with no forecast at that horizon.
    """

    model_id: str
    start: datetime
    end: datetime
    horizon_min: int
    minutes: np.ndarray
    actual: np.ndarray
    point: np.ndarray
    quantiles: dict[str, np.ndarray] = field(default_factory=dict)  # level ("0.9") -> values

    @property
    def band(self) -> tuple[str, str] | None:
        """The widest stored band (lowest and highest level), or None with fewer than two levels."""
        if len(self.quantiles) < 2:
            return None
        levels = sorted(self.quantiles, key=float)
        return levels[0], levels[-1]

    def error(self) -> ForecastError:
        band = self.band
        if band is None:
            return forecast_error(self.actual, self.point)
        return forecast_error(self.actual, self.point, self.quantiles[band[0]], self.quantiles[band[1]])


def read_forecast_series(conn: Connection, *, model_id: str, start: datetime, end: datetime,
                         horizon_min: int) -> ForecastSeries:
    """Actual counts and the forecast made ``horizon_min`` minutes ahead, per minute of ``[start, end)``.

    Args:
        conn: an open connection.
        model_id: the serving model.
        start: first minute (UTC, whole minute).
        end: end of the window, exclusive (UTC, whole minute).
        horizon_min: minutes between the issuing minute and the target minute (0 = the issuing minute).

    When two runs were issued in the same minute, the later one counts.
    """
    n = int((end - start) / MINUTE)
    origin = start.timestamp()
    minutes = origin + 60.0 * np.arange(n)
    counts = read_counts(conn, [model_id], start, end)
    actual = counts["y"].to_numpy(dtype="float64")
    rows = conn.execute(
        text(f"SELECT DISTINCT ON (target_minute) target_minute, point, quantiles FROM forecasts "
             f"WHERE model_id = :m AND {HORIZON_MIN_SQL} = :h AND target_minute >= :s AND target_minute < :e "
             "ORDER BY target_minute, issued_at DESC"),
        {"m": model_id, "h": horizon_min, "s": start, "e": end},
    ).all()
    point = np.full(n, np.nan)
    quantiles: dict[str, np.ndarray] = {}
    for target, value, levels in rows:
        i = int(round((target.timestamp() - origin) / 60.0))
        if not 0 <= i < n:
            continue  # defensive: the query keeps targets inside the window
        point[i] = value
        for level, q in (levels or {}).items():
            if level not in quantiles:
                if not _is_level(level):
                    continue  # not a quantile level ("0.9"): nothing to draw it as
                quantiles[level] = np.full(n, np.nan)
            quantiles[level][i] = q
    return ForecastSeries(model_id=model_id, start=start, end=end, horizon_min=horizon_min,
                          minutes=minutes.astype(np.int64), actual=actual, point=point,
                          quantiles=dict(sorted(quantiles.items(), key=lambda kv: float(kv[0]))))


@dataclass(frozen=True)
class ColdStartView:
    """Observed cold starts in a window, and predicted ones when the store holds any.

    Attributes:
        observed: one dict per event (``started_at``, ``node_id``, ``total_seconds``, phases, ``cache_state``).
        predicted: stored predictions; empty while nothing stores them.
        predicted_stored: False when the store has no cold-start predictions at all.
        lead_time_s: the cold-start seconds the recommendation endpoint assumes now (median of the last 20
            observed starts), or None when none was observed.
    """

    observed: list[dict]
    predicted: list[dict]
    predicted_stored: bool
    lead_time_s: float | None


COLD_START_COLUMNS = ("started_at", "node_id", "total_seconds", "image_pull_s", "weight_fetch_s", "weight_load_s",
                      "runtime_init_s", "registration_s", "cache_state", "source")


def read_cold_starts(conn: Connection, *, model_id: str, start: datetime, end: datetime,
                     limit: int = 10_000) -> ColdStartView:
    """Cold starts of ``model_id`` that began in ``[start, end)``, oldest first (at most ``limit``).

    No table holds predicted cold starts yet (the latency model of the planning
    work does not store its predictions), so ``predicted`` is empty and
    ``predicted_stored`` False; callers say so rather than draw nothing.
    """
    rows = conn.execute(
        text(f"SELECT {', '.join(COLD_START_COLUMNS)} FROM cold_starts "
             "WHERE model_id = :m AND started_at >= :s AND started_at < :e ORDER BY started_at, node_id LIMIT :n"),
        {"m": model_id, "s": start, "e": end, "n": limit},
    ).mappings().all()
    lead = recent_cold_start_seconds(conn, model_id=model_id)
    return ColdStartView(observed=[dict(r) for r in rows], predicted=[], predicted_stored=False,
                         lead_time_s=None if lead is None else float(lead))


ACTION_COLUMNS = ("id", "plan_id", "kind", "node_id", "target", "spec", "not_before", "deadline", "reason",
                  "expected_benefit", "expected_cost", "status", "status_reason", "attempts", "updated_at")


def read_action_timeline(conn: Connection, *, model_id: str, start: datetime, end: datetime,
                         limit: int = 5_000) -> tuple[list[dict], int]:
    """Actions of ``model_id`` whose span ``[not_before, deadline]`` meets ``[start, end)``, oldest first.

    An action without ``not_before`` sits at its ``updated_at``. Actions that
    began more than :data:`ACTION_LOOKBACK` before ``start`` are not looked at.

    Returns:
        (up to ``limit`` actions as dicts, how many matched in all).
    """
    where = (f"WHERE model_id = :m AND {ACTION_TIME_SQL} >= :lookback AND {ACTION_TIME_SQL} < :e "
             "AND coalesce(deadline, not_before, updated_at) >= :s")
    params = {"m": model_id, "s": start, "e": end, "lookback": start - ACTION_LOOKBACK}
    rows = conn.execute(
        text(f"SELECT {', '.join(ACTION_COLUMNS)} FROM actions {where} ORDER BY {ACTION_TIME_SQL}, id LIMIT :n"),
        {**params, "n": limit},
    ).mappings().all()
    total = len(rows) if len(rows) < limit else conn.execute(text(f"SELECT count(*) FROM actions {where}"),
                                                             params).scalar_one()
    return [dict(r) for r in rows], total


@dataclass(frozen=True)
class FleetRow:
    """One model's forecast error and pre-warm record over the fleet window.

    Attributes:
        model_id: the serving model.
        error: forecast error at the window's horizon (MAE, wMAPE; band coverage not computed here).
        actual_total: invocations in the scored minutes.
        forecast_total: forecast invocations in the scored minutes.
        cold_starts: observed cold starts that began in the window.
        actions_total: actions planned in the window (by :data:`ACTION_TIME_SQL`).
        actions_succeeded: of those, succeeded.
        actions_failed: of those, failed or dropped.
        expected_wait_avoided_s: the planner's expected cold-start seconds avoided by the succeeded actions.
        last_forecast_at: when the model's newest forecast was issued (any time), or None.
    """

    model_id: str
    error: ForecastError
    actual_total: float
    forecast_total: float
    cold_starts: int
    actions_total: int
    actions_succeeded: int
    actions_failed: int
    expected_wait_avoided_s: float
    last_forecast_at: datetime | None


_FLEET_SQL = f"""
WITH cov AS (
    SELECT model_id, range_agg(ranges) AS ranges FROM coverage
    WHERE 60 % step_seconds = 0 AND ranges && tstzrange(:s, :e, '[)') GROUP BY model_id
)
SELECT m.id, err.n, err.abs_err, err.actual, err.forecast, cs.n AS cold_starts,
       ac.total, ac.succeeded, ac.failed, ac.benefit, lf.issued_at
FROM serving_models m
LEFT JOIN cov ON cov.model_id = m.id
LEFT JOIN LATERAL (
    SELECT count(*) AS n, sum(abs(f.point - coalesce(i.count, 0))) AS abs_err,
           sum(coalesce(i.count, 0)) AS actual, sum(f.point) AS forecast
    FROM (
        SELECT DISTINCT ON (target_minute) target_minute, point FROM forecasts
        WHERE model_id = m.id AND {HORIZON_MIN_SQL} = :h AND target_minute >= :s AND target_minute < :e
        ORDER BY target_minute, issued_at DESC
    ) f
    -- One range read of the model's counts, merged with the forecast minutes (not one probe per minute).
    LEFT JOIN (
        SELECT minute, sum(count) AS count FROM invocations
        WHERE model_id = m.id AND minute >= :s AND minute < :e GROUP BY minute
    ) i ON i.minute = f.target_minute
    WHERE cov.ranges @> tstzrange(f.target_minute, f.target_minute + interval '1 minute', '[)')
) err ON true
LEFT JOIN LATERAL (
    SELECT count(*) AS n FROM cold_starts c WHERE c.model_id = m.id AND c.started_at >= :s AND c.started_at < :e
) cs ON true
LEFT JOIN LATERAL (
    SELECT count(*) AS total, count(*) FILTER (WHERE status = 'succeeded') AS succeeded,
           count(*) FILTER (WHERE status IN ('failed', 'dropped')) AS failed,
           coalesce(sum(expected_benefit) FILTER (WHERE status = 'succeeded'), 0) AS benefit
    FROM actions a WHERE a.model_id = m.id AND {ACTION_TIME_SQL} >= :s AND {ACTION_TIME_SQL} < :e
) ac ON true
LEFT JOIN LATERAL (
    SELECT issued_at FROM forecasts f WHERE f.model_id = m.id ORDER BY issued_at DESC LIMIT 1
) lf ON true
"""


def read_fleet(conn: Connection, *, end: datetime, window_min: int, horizon_min: int) -> list[FleetRow]:
    """Every registered model's forecast error at ``horizon_min`` over the ``window_min`` minutes before ``end``.

    Counts of cold starts and actions cover the same window. Models without
    forecasts or known actuals have ``error.scored_minutes == 0``. One query;
    order is left to the caller.
    """
    start = end - window_min * MINUTE
    rows = conn.execute(text(_FLEET_SQL), {"h": horizon_min, "s": start, "e": end}).all()
    out = []
    for (model_id, n, abs_err, actual, forecast, cold, total, succeeded, failed, benefit, last) in rows:
        n = int(n or 0)
        actual = float(actual or 0.0)
        error = ForecastError(
            scored_minutes=n,
            mae=float(abs_err) / n if n else None,
            wmape=float(abs_err) / actual if n and actual > 0 else None,
        )
        out.append(FleetRow(model_id=model_id, error=error, actual_total=actual,
                            forecast_total=float(forecast or 0.0), cold_starts=int(cold), actions_total=int(total),
                            actions_succeeded=int(succeeded), actions_failed=int(failed),
                            expected_wait_avoided_s=float(benefit), last_forecast_at=last))
    return out


def finite_or_none(values: np.ndarray) -> list[float | None]:
    """A JSON-ready list: NaN becomes None."""
    return [None if math.isnan(v) else v for v in values.tolist()]
