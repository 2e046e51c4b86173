"""Replica recommendations for reactive autoscalers (KEDA, Knative, HPA) from a stored forecast.

A pure function: the latest forecast's chosen quantile, divided by what one
replica serves, gives the replicas needed now and the replicas that must be
ready by the time a replica started now would be ready (the cold-start lead
time). Autoscalers read ``replicas_at_lead_time`` so that they start replicas
early enough.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta

import pandas as pd

from forecaster.store.forecasts import StoredForecast, quantile_columns

#: Below this forecast (requests per minute), no replica is needed.
MIN_DEMAND_PER_MIN = 0.5


@dataclass(frozen=True)
class Recommendation:
    model_id: str
    replicas_now: int | None
    replicas_at_lead_time: int | None
    lead_time_s: float
    quantile: float | None
    demand_now_per_min: float | None
    demand_at_lead_time_per_min: float | None
    reason: str  # forecast | no_forecast | forecast_expired
    forecast_issued_at: datetime | None
    forecast_age_s: float | None
    model_version_id: str | None

    def as_dict(self) -> dict:
        return asdict(self)


def replicas_for(demand_per_min: float, replica_rps: float | None) -> int:
    """Replicas that serve ``demand_per_min`` when one serves ``replica_rps`` requests per second."""
    if demand_per_min < MIN_DEMAND_PER_MIN:
        return 0
    if not replica_rps:
        return 1
    return max(1, math.ceil(demand_per_min / (replica_rps * 60.0) - 1e-9))


def _pick_quantile(frame: pd.DataFrame, quantile: float) -> tuple[str, float]:
    levels = quantile_columns(frame)
    if not levels:
        return "point", float("nan")
    column = min(levels, key=lambda c: (abs(levels[c] - quantile), -levels[c]))
    return column, levels[column]


def recommend(
    forecast: StoredForecast | None,
    *,
    model_id: str,
    now: datetime,
    lead_time_s: float,
    replica_rps: float | None,
    quantile: float = 0.9,
) -> Recommendation:
    """Replicas to have ready now and at ``now + lead_time_s``.

    The demand at lead time is the largest forecast over the minute in which a
    replica started now would become ready, so a ramp inside that minute is
    covered.
    """
    if forecast is None or forecast.frame.empty:
        return Recommendation(model_id, None, None, lead_time_s, None, None, None, "no_forecast", None, None, None)
    frame = forecast.frame
    column, level = _pick_quantile(frame, quantile)
    minutes = pd.to_datetime(frame["target_minute"], utc=True)
    now_ts = pd.Timestamp(now).tz_convert("UTC")
    age_s = (now_ts - pd.Timestamp(forecast.issued_at).tz_convert("UTC")).total_seconds()
    current = now_ts.floor("min")
    ready_at = (now_ts + timedelta(seconds=lead_time_s)).floor("min")
    values = frame[column].astype(float).to_numpy()
    at_now = values[(minutes == current).to_numpy()]
    at_lead = values[((minutes >= ready_at) & (minutes <= ready_at + pd.Timedelta(minutes=1))).to_numpy()]
    if len(at_lead) == 0:
        return Recommendation(model_id, None, None, lead_time_s, None if column == "point" else level, None, None,
                              "forecast_expired", forecast.issued_at, age_s, forecast.model_version_id)
    demand_now = float(at_now[0]) if len(at_now) else float(values[0])
    demand_lead = float(at_lead.max())
    return Recommendation(
        model_id=model_id,
        replicas_now=replicas_for(demand_now, replica_rps),
        replicas_at_lead_time=replicas_for(demand_lead, replica_rps),
        lead_time_s=lead_time_s,
        quantile=None if column == "point" else level,
        demand_now_per_min=demand_now,
        demand_at_lead_time_per_min=demand_lead,
        reason="forecast",
        forecast_issued_at=forecast.issued_at,
        forecast_age_s=age_s,
        model_version_id=forecast.model_version_id,
    )
