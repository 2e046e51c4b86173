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
#: Most replicas a recommendation names (a gRPC int64, a JSON number every client reads, an HPA's int32): a
#: forecast that asks for more is answered with this many and reason ``replicas_capped``.
MAX_REPLICAS = 2**31 - 1


@dataclass(frozen=True)
class Recommendation:
    model_id: str
    replicas_now: int | None
    replicas_at_lead_time: int | None
    lead_time_s: float
    quantile: float | None
    demand_now_per_min: float | None
    demand_at_lead_time_per_min: float | None
    # forecast | replicas_capped | no_forecast | forecast_stale | forecast_expired | forecast_invalid
    reason: str
    forecast_issued_at: datetime | None
    forecast_age_s: float | None
    model_version_id: str | None

    def as_dict(self) -> dict:
        return asdict(self)


def replicas_for(demand_per_min: float, replica_rps: float | None) -> int:
    """Replicas that serve ``demand_per_min`` when one serves ``replica_rps`` requests per second."""
    if not demand_per_min >= MIN_DEMAND_PER_MIN:  # NaN too (callers refuse it first: forecast_invalid)
        return 0
    if not replica_rps:
        return 1
    needed = demand_per_min / (replica_rps * 60.0) - 1e-9
    if not needed < MAX_REPLICAS:  # infinity too
        return MAX_REPLICAS
    return max(1, math.ceil(needed))


def usable_values(values: np.ndarray) -> bool:
    """Whether a forecast's demand column can be served: every value finite and >= 0 (the store refuses others
    at write; a run stored before that, or written around it, answers ``forecast_invalid``)."""
    values = np.asarray(values, dtype="float64")
    return bool(((values >= 0) & np.isfinite(values)).all())


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


def _demand_at(forecast: MinuteQuantiles, quantile: float) -> tuple[float | None, np.ndarray]:
    """(level used, demand per minute): the stored level nearest ``quantile`` (the higher on a tie), else the point."""
    if not forecast.levels:
        return None, forecast.point
    column = min(range(len(forecast.levels)), key=lambda j: (abs(forecast.levels[j] - quantile), -forecast.levels[j]))
    return forecast.levels[column], forecast.values[:, column]


def _minute_starts(now: datetime, lead_time_s: float) -> tuple[float, float]:
    """(current minute, minute a replica started now is ready in) as epoch seconds."""
    now_s = now.timestamp()
    return now_s // 60 * 60, (now_s + lead_time_s) // 60 * 60


def _as_minutes(forecast: StoredForecast | MinuteQuantiles | None) -> MinuteQuantiles | None:
    if isinstance(forecast, StoredForecast):
        return MinuteQuantiles.from_stored(forecast) if not forecast.frame.empty else None
    return forecast


def demand_within_lead(
    forecast: StoredForecast | MinuteQuantiles | None,
    *,
    now: datetime,
    lead_time_s: float,
    quantile: float = 0.9,
) -> float | None:
    """The largest forecast demand (requests per minute) from the current minute to the end of the lead window.

    The window is the current minute through the minute after the one in which a replica started now would be
    ready (the same end as :func:`recommend`'s lead window), so a spike anywhere before it counts: what an
    autoscaler that scales from zero must see to wake up early enough. None when the forecast does not reach the
    lead window (no forecast, or expired).
    """
    forecast = _as_minutes(forecast)
    if forecast is None or not len(forecast.minutes_s):
        return None
    _, values = _demand_at(forecast, quantile)
    if not usable_values(values):
        return None
    current, ready_at = _minute_starts(now, lead_time_s)
    if not ((forecast.minutes_s >= ready_at) & (forecast.minutes_s <= ready_at + 60)).any():
        return None
    window = values[(forecast.minutes_s >= current) & (forecast.minutes_s <= ready_at + 60)]
    return float(window.max())


def recommend(
    forecast: StoredForecast | MinuteQuantiles | None,
    *,
    model_id: str,
    now: datetime,
    lead_time_s: float,
    replica_rps: float | None,
    quantile: float = 0.9,
    max_age_s: float | None = None,
) -> Recommendation:
    """Replicas to have ready now and at ``now + lead_time_s``.

    The demand at lead time is the largest forecast over the minute in which a
    replica started now would become ready and the one after, so a ramp there
    is covered.

    A forecast issued more than ``max_age_s`` seconds before ``now`` (the API passes
    ``PREWARM_FORECAST_FRESH_S``) gives no replicas, reason ``forecast_stale``: a run
    covers an hour, so without the limit a forecast job that stopped would go on
    being served as current for that hour, and autoscalers would never fall back.
    None: no limit.

    A forecast whose demand column holds an infinite, NaN or negative value gives no replicas, reason
    ``forecast_invalid`` (autoscalers fall back as for ``forecast_stale``); one that asks for more than
    :data:`MAX_REPLICAS` replicas gives that many, reason ``replicas_capped``.
    """
    forecast = _as_minutes(forecast)
    if forecast is None or not len(forecast.minutes_s):
        return Recommendation(model_id, None, None, lead_time_s, None, None, None, "no_forecast", None, None, None)
    level, values = _demand_at(forecast, quantile)
    age_s = now.timestamp() - forecast.issued_at.timestamp()
    if max_age_s is not None and age_s > max_age_s:
        return Recommendation(model_id, None, None, lead_time_s, level, None, None, "forecast_stale",
                              forecast.issued_at, age_s, forecast.model_version_id)
    if not usable_values(values):
        return Recommendation(model_id, None, None, lead_time_s, level, None, None, "forecast_invalid",
                              forecast.issued_at, age_s, forecast.model_version_id)
    current, ready_at = _minute_starts(now, lead_time_s)
    at_now = values[forecast.minutes_s == current]
    at_lead = values[(forecast.minutes_s >= ready_at) & (forecast.minutes_s <= ready_at + 60)]
    if len(at_lead) == 0:
        return Recommendation(model_id, None, None, lead_time_s, level, None, None, "forecast_expired",
                              forecast.issued_at, age_s, forecast.model_version_id)
    demand_now = float(at_now[0]) if len(at_now) else float(values[0])
    demand_lead = float(at_lead.max())
    replicas_now, replicas_lead = replicas_for(demand_now, replica_rps), replicas_for(demand_lead, replica_rps)
    return Recommendation(
        model_id=model_id,
        replicas_now=replicas_now,
        replicas_at_lead_time=replicas_lead,
        lead_time_s=lead_time_s,
        quantile=level,
        demand_now_per_min=demand_now,
        demand_at_lead_time_per_min=demand_lead,
        reason="replicas_capped" if max(replicas_now, replicas_lead) >= MAX_REPLICAS else "forecast",
        forecast_issued_at=forecast.issued_at,
        forecast_age_s=age_s,
        model_version_id=forecast.model_version_id,
    )
