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
from datetime import datetime

import numpy as np
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


@dataclass(frozen=True)
class MinuteQuantiles:
    """One forecast run of one model as arrays: what a recommendation reads, cheap to keep for 100,000 models."""

    issued_at: datetime
    model_version_id: str | None
    minutes_s: np.ndarray  # (T,) target minute starts, epoch seconds
    levels: tuple[float, ...]  # quantile levels of the columns of ``values``
    values: np.ndarray  # (T, L) invocations per minute
    point: np.ndarray  # (T,)

    @classmethod
    def from_stored(cls, forecast: StoredForecast) -> "MinuteQuantiles":
        columns = quantile_columns(forecast.frame)
        minutes = pd.to_datetime(forecast.frame["target_minute"], utc=True)
        return cls(
            issued_at=forecast.issued_at,
            model_version_id=forecast.model_version_id,
            minutes_s=minutes.dt.tz_convert(None).to_numpy().astype("datetime64[s]").astype("int64"),
            levels=tuple(columns.values()),
            values=forecast.frame[list(columns)].to_numpy(dtype="float64") if columns else np.empty((len(minutes), 0)),
            point=forecast.frame["point"].to_numpy(dtype="float64"),
        )


def recommend(
    forecast: StoredForecast | MinuteQuantiles | None,
    *,
    model_id: str,
    now: datetime,
    lead_time_s: float,
    replica_rps: float | None,
    quantile: float = 0.9,
) -> Recommendation:
    """Replicas to have ready now and at ``now + lead_time_s``.

    The demand at lead time is the largest forecast over the minute in which a
    replica started now would become ready and the one after, so a ramp there
    is covered.
    """
    if isinstance(forecast, StoredForecast):
        forecast = MinuteQuantiles.from_stored(forecast) if not forecast.frame.empty else None
    if forecast is None or not len(forecast.minutes_s):
        return Recommendation(model_id, None, None, lead_time_s, None, None, None, "no_forecast", None, None, None)
    if forecast.levels:
        column = min(range(len(forecast.levels)),
                     key=lambda j: (abs(forecast.levels[j] - quantile), -forecast.levels[j]))
        level: float | None = forecast.levels[column]
        values = forecast.values[:, column]
    else:
        level, values = None, forecast.point
    now_s = now.timestamp()
    age_s = now_s - forecast.issued_at.timestamp()
    current = now_s // 60 * 60
    ready_at = (now_s + lead_time_s) // 60 * 60
    at_now = values[forecast.minutes_s == current]
    at_lead = values[(forecast.minutes_s >= ready_at) & (forecast.minutes_s <= ready_at + 60)]
    if len(at_lead) == 0:
        return Recommendation(model_id, None, None, lead_time_s, level, None, None, "forecast_expired",
                              forecast.issued_at, age_s, forecast.model_version_id)
    demand_now = float(at_now[0]) if len(at_now) else float(values[0])
    demand_lead = float(at_lead.max())
    return Recommendation(
        model_id=model_id,
        replicas_now=replicas_for(demand_now, replica_rps),
        replicas_at_lead_time=replicas_for(demand_lead, replica_rps),
        lead_time_s=lead_time_s,
        quantile=level,
        demand_now_per_min=demand_now,
        demand_at_lead_time_per_min=demand_lead,
        reason="forecast",
        forecast_issued_at=forecast.issued_at,
        forecast_age_s=age_s,
        model_version_id=forecast.model_version_id,
    )
