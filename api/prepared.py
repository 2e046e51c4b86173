"""Recommendation bodies prepared when a forecast run lands, so that a request only fills in the clock's part.

A recommendation (:func:`forecaster.planning.recommendation.recommend`) depends
on the request only through ``now``: the forecast, the replica size, the lead
time and the default quantile are fixed until the snapshot changes. So when it
changes, :func:`prepare_recommendation` cuts each model's answer into JSON
bytes that do not move (model id, lead time, level, issue time, version) and
the one column of demand per target minute that the default quantile reads.
A request then picks the minute now and at the lead time by arithmetic, and
joins bytes: no pydantic model, no dict, no validation.

The bytes are exactly what FastAPI sends for :class:`api.schemas.RecommendationPublic`
(pydantic's JSON serializer writes every value here, in the schema's field
order; ``tests/test_api_prepared.py`` compares the two over many clocks,
forecasts and ids). What cannot be answered by arithmetic (non-consecutive
target minutes) gets no prepared body, and the request takes the full path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from pydantic_core import to_json

from forecaster.planning.recommendation import MAX_REPLICAS, MinuteQuantiles, replicas_for, usable_values

_STALE = (b',"stale":false}', b',"stale":true}')


def _json(value) -> bytes:
    return to_json(value)


@dataclass(slots=True)
class PreparedRecommendation:
    """One model's recommendation body less what depends on the clock; :meth:`body` completes it.

    ``demand`` is None when the model has no forecast (the body is then fixed
    but for ``stale``).
    """

    head: bytes  # {"model_id":...,"replicas_now":
    lead_time_s: float
    lead_and_level: bytes  # ,"lead_time_s":...,"quantile":...
    issued_and_after: bytes  # ,"reason":"forecast","forecast_issued_at":...,"forecast_age_s":
    expired_issued: bytes  # the same for reason forecast_expired
    stale_issued: bytes  # the same for reason forecast_stale
    version: bytes  # ,"model_version_id":...
    replica_rps: float | None
    issued_at_s: float | None
    first_minute_s: float
    demand: np.ndarray | None  # the default quantile's column (invocations per minute), one per target minute
    fixed: bytes | None  # the whole body less the stale flag, when no forecast
    max_age_s: float | None = None  # older forecasts answer forecast_stale (recommend()'s max_age_s)
    capped_issued: bytes = b""  # issued_and_after for reason replicas_capped (more than MAX_REPLICAS asked for)

    def body(self, now_s: float, stale: bool) -> bytes:
        """The response body at ``now_s`` (epoch seconds), as :func:`recommend` and the schema would make it."""
        if self.demand is None:
            return self.fixed + _STALE[stale]
        demand = self.demand
        minutes = len(demand)
        age_s = now_s - self.issued_at_s
        age = _json(age_s)
        if self.max_age_s is not None and age_s > self.max_age_s:
            return b"".join((self.head, b'null,"replicas_at_lead_time":null', self.lead_and_level,
                             b',"demand_now_per_min":null,"demand_at_lead_time_per_min":null', self.stale_issued,
                             age, self.version, _STALE[stale]))
        current = now_s // 60 * 60
        ready_at = (now_s + self.lead_time_s) // 60 * 60
        first = int((ready_at - self.first_minute_s) // 60)
        lead_at = [k for k in (first, first + 1) if 0 <= k < minutes]
        if not lead_at:
            return b"".join((self.head, b'null,"replicas_at_lead_time":null', self.lead_and_level,
                             b',"demand_now_per_min":null,"demand_at_lead_time_per_min":null', self.expired_issued,
                             age, self.version, _STALE[stale]))
        index_now = int((current - self.first_minute_s) // 60)
        demand_now = float(demand[index_now] if 0 <= index_now < minutes else demand[0])
        demand_lead = float(max(demand[k] for k in lead_at))
        replicas_now, replicas_lead = replicas_for(demand_now, self.replica_rps), replicas_for(demand_lead,
                                                                                               self.replica_rps)
        return b"".join((
            self.head, str(replicas_now).encode(), b',"replicas_at_lead_time":',
            str(replicas_lead).encode(), self.lead_and_level,
            b',"demand_now_per_min":', _json(demand_now), b',"demand_at_lead_time_per_min":', _json(demand_lead),
            self.capped_issued if max(replicas_now, replicas_lead) >= MAX_REPLICAS else self.issued_and_after,
            age, self.version, _STALE[stale]))


_COLUMNS: dict[tuple, int | None] = {}


def _column(forecast: MinuteQuantiles, quantile: float) -> tuple[float | None, np.ndarray]:
    """The level and values :func:`recommend` reads for ``quantile`` (nearest level; ties to the higher)."""
    levels = forecast.levels
    if not levels:
        return None, forecast.point
    key = (levels, quantile)
    column = _COLUMNS.get(key)
    if column is None:  # the same few level sets for a whole fleet: chosen once each
        column = min(range(len(levels)), key=lambda j: (abs(levels[j] - quantile), -levels[j]))
        if len(_COLUMNS) < 1024:
            _COLUMNS[key] = column
    return levels[column], forecast.values[:, column]


class _Fragments:
    """JSON fragments shared by many models (one run's issue time and version, a lead time), made once each."""

    def __init__(self) -> None:
        self.issued: dict[tuple, tuple[bytes, bytes, bytes, bytes, bytes]] = {}
        self.numbers: dict[float | None, bytes] = {}

    def number(self, value: float | None) -> bytes:
        made = self.numbers.get(value)
        if made is None:
            made = self.numbers[value] = _json(value)
        return made

    def run(self, forecast: MinuteQuantiles) -> tuple[bytes, bytes, bytes, bytes, bytes]:
        key = (forecast.issued_at, forecast.model_version_id)
        made = self.issued.get(key)
        if made is None:
            issued = _json(forecast.issued_at)
            made = self.issued[key] = (
                b',"reason":"forecast","forecast_issued_at":' + issued + b',"forecast_age_s":',
                b',"reason":"forecast_expired","forecast_issued_at":' + issued + b',"forecast_age_s":',
                b',"reason":"forecast_stale","forecast_issued_at":' + issued + b',"forecast_age_s":',
                b',"model_version_id":' + _json(forecast.model_version_id),
                b',"reason":"replicas_capped","forecast_issued_at":' + issued + b',"forecast_age_s":')
        return made


def prepare_recommendation(model_id: str, forecast: MinuteQuantiles | None, *, lead_time_s: float,
                           replica_rps: float | None, quantile: float, max_age_s: float | None = None,
                           fragments: _Fragments | None = None) -> PreparedRecommendation | None:
    """The prepared body of ``model_id``'s default recommendation; None when only the full path can answer it.

    Args:
        forecast: the model's newest run (None: no forecast yet).
        lead_time_s: seconds, as the route passes it to :func:`recommend`.
        replica_rps: requests per second one replica serves (None: unknown, one replica).
        quantile: the default demand quantile (``PREWARM_RECOMMENDATION_QUANTILE``).
        max_age_s: the forecast's age past which the body says ``forecast_stale`` (``PREWARM_FORECAST_FRESH_S``,
            as the route passes it to :func:`recommend`); None: no limit.
        fragments: shared fragments (:func:`fragments`) when preparing a whole fleet.
    """
    fragments = fragments or _Fragments()
    lead_time_s = float(lead_time_s)
    head = b'{"model_id":' + _json(model_id) + b',"replicas_now":'
    lead = b',"lead_time_s":' + fragments.number(lead_time_s)
    if forecast is None or not len(forecast.minutes_s):
        rest = (b',"quantile":null,"demand_now_per_min":null,"demand_at_lead_time_per_min":null,'
                b'"reason":"no_forecast","forecast_issued_at":null,"forecast_age_s":null,"model_version_id":null')
        fixed = b"".join((head, b'null,"replicas_at_lead_time":null', lead, rest))
        return PreparedRecommendation(head, lead_time_s, b"", b"", b"", b"", b"", replica_rps, None, 0.0, None, fixed,
                                      max_age_s)
    minutes = forecast.minutes_s
    # target minutes ascend by construction (first_target + k * step, NULL elements left out): consecutive
    # whole minutes exactly when the span is 60 s per step
    if minutes[-1] - minutes[0] != 60 * (len(minutes) - 1):
        return None  # gaps, or another step: recommend()'s masks, on the full path
    level, demand = _column(forecast, quantile)
    if not usable_values(demand):
        return None  # forecast_invalid: recommend() answers it, on the full path
    issued_and_after, expired_issued, stale_issued, version, capped_issued = fragments.run(forecast)
    return PreparedRecommendation(
        head, lead_time_s, lead + b',"quantile":' + fragments.number(None if level is None else float(level)),
        issued_and_after, expired_issued, stale_issued, version, replica_rps, forecast.issued_at.timestamp(),
        float(minutes[0]), np.ascontiguousarray(demand, dtype="float64"), None, max_age_s, capped_issued)


def fragments() -> _Fragments:
    """A fresh cache of shared fragments, for one preparation of a fleet."""
    return _Fragments()
