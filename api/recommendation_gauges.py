"""``prewarm_recommended_replicas`` for every model, written as exposition text from arrays.

The gauge (for an HPA through prometheus-adapter, docs/autoscalers.md) holds two samples per model, so a
100,000-model fleet's ``/metrics`` has 200,000 of them. Made the plain way, a :func:`recommend` call per model and
prometheus_client formatting every sample, a scrape took 2.9 s of the API process (``bench/dashboard.py``,
2026-12-06), time in which that worker answers no recommendation.

Here the snapshot's prepared bodies (:mod:`api.prepared`, remade when a forecast run lands) are stacked into
arrays once per snapshot change: each model's demand column at the default quantile, its first target minute,
lead time and replica size, and the text of its two label sets. A scrape then computes every model's replicas at
once with numpy, as :meth:`~api.prepared.PreparedRecommendation.body` does for one, and joins the lines. Models
whose forecast a prepared body cannot answer (target minutes with gaps) take :func:`recommend` itself, as the REST
route does. The values are :func:`recommend`'s (``tests/test_recommendation_gauges.py`` compares the two over
clocks, forecasts and ids).

A model whose forecast is older than ``PREWARM_FORECAST_FRESH_S`` has no samples, as one whose forecast has expired:
an HPA reading it through prometheus-adapter then gets no value for the metric (an error) instead of an hour-old
floor served as current: it scales up on its other metrics and skips scaling down while one fails.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

import numpy as np
from prometheus_client.utils import floatToGoString

from forecaster.planning.recommendation import MAX_REPLICAS, MIN_DEMAND_PER_MIN, recommend

NAME = "prewarm_recommended_replicas"
HEADER = (f"# HELP {NAME} Replicas to have ready, now and at the cold-start lead time\n"
          f"# TYPE {NAME} gauge\n")


def _label_value(value: str) -> str:
    """A label value as the text format writes it (prometheus_client's escaping: backslash, newline, quote)."""
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _prefixes(model_id: str) -> tuple[str, str]:
    """The two samples' text up to the value (labels in name order, as prometheus_client sorts them)."""
    label = _label_value(model_id)
    return f'{NAME}{{at="now",model_id="{label}"}} ', f'{NAME}{{at="lead_time",model_id="{label}"}} '


@dataclass(frozen=True)
class _Stacked:
    """One snapshot's prepared bodies as arrays (rows: models with a prepared forecast) and the rest by id."""

    prefixes: list[tuple[str, str]]
    first_minute_s: np.ndarray  # (N,) epoch seconds of each run's first target minute
    issued_at_s: np.ndarray  # (N,) epoch seconds each run was issued at
    lead_time_s: np.ndarray  # (N,)
    replica_rps: np.ndarray  # (N,) NaN: unknown (one replica serves any demand above the minimum)
    minutes: np.ndarray  # (N,) target minutes each run holds
    demand: np.ndarray  # (N, max minutes) the default quantile's column, NaN past a run's end
    full_path: list[str]  # models no prepared body answers: recommend() per scrape


def _stack(prepared: dict) -> _Stacked:
    rows = [(model_id, body) for model_id, body in prepared.items() if body is not None and body.demand is not None]
    width = max((len(body.demand) for _, body in rows), default=0)
    demand = np.full((len(rows), max(width, 1)), np.nan)
    for i, (_, body) in enumerate(rows):
        demand[i, :len(body.demand)] = body.demand
    return _Stacked(
        prefixes=[_prefixes(model_id) for model_id, _ in rows],
        first_minute_s=np.array([body.first_minute_s for _, body in rows], dtype="float64"),
        issued_at_s=np.array([body.issued_at_s for _, body in rows], dtype="float64"),
        lead_time_s=np.array([body.lead_time_s for _, body in rows], dtype="float64"),
        replica_rps=np.array([np.nan if not body.replica_rps else body.replica_rps for _, body in rows],
                             dtype="float64"),
        minutes=np.array([len(body.demand) for _, body in rows], dtype=np.int64),
        demand=demand,
        full_path=[model_id for model_id, body in prepared.items() if body is None])


def replicas_for_array(demand_per_min: np.ndarray, replica_rps: np.ndarray) -> np.ndarray:
    """:func:`~forecaster.planning.recommendation.replicas_for` elementwise (NaN ``replica_rps``: unknown), capped at
    ``MAX_REPLICAS`` as it is."""
    with np.errstate(invalid="ignore", divide="ignore"):
        sized = np.minimum(np.maximum(1.0, np.ceil(demand_per_min / (replica_rps * 60.0) - 1e-9)), MAX_REPLICAS)
    return np.where(demand_per_min < MIN_DEMAND_PER_MIN, 0.0, np.where(np.isnan(replica_rps), 1.0, sized))


class RecommendationGauges:
    """The gauge's exposition text at the clock's ``now`` for the snapshot's models (see the module docstring)."""

    def __init__(self, snapshot, settings, clock: Callable[[], datetime]) -> None:
        self._snapshot = snapshot
        self._settings = settings
        self._clock = clock
        self._stacked: tuple[dict | None, _Stacked | None] = (None, None)
        self._values: dict[float, str] = {}

    def _arrays(self) -> _Stacked:
        prepared = self._snapshot.prepared  # replaced, never mutated, on each refresh: its identity is the key
        held, stacked = self._stacked
        if held is not prepared or stacked is None:
            stacked = _stack(prepared)
            self._stacked = (prepared, stacked)  # holds the dict, so its id cannot be reused while cached
        return stacked

    def _value(self, replicas: float) -> str:
        text = self._values.get(replicas)
        if text is None:
            text = floatToGoString(replicas) + "\n"
            if len(self._values) < 4096:
                self._values[replicas] = text
        return text

    def exposition(self) -> bytes:
        """``# HELP``/``# TYPE`` and two samples per model with a fresh forecast that reaches the lead time."""
        now = self._clock()
        now_s = now.timestamp()
        max_age_s = self._settings.forecast_fresh_s
        s = self._arrays()
        lines = [HEADER]
        if len(s.prefixes):
            rows = np.arange(len(s.prefixes))
            last = s.minutes - 1
            # as PreparedRecommendation.body: the minute a replica started now is ready in and the one after
            ready_at = (now_s + s.lead_time_s) // 60 * 60
            first = ((ready_at - s.first_minute_s) // 60).astype(np.int64)
            at_lead = np.full(len(rows), -np.inf)
            for k in (first, first + 1):
                inside = (k >= 0) & (k <= last)
                at_lead = np.where(inside, np.maximum(at_lead, s.demand[rows, np.clip(k, 0, last)]), at_lead)
            index_now = ((now_s // 60 * 60 - s.first_minute_s) // 60).astype(np.int64)
            inside = (index_now >= 0) & (index_now <= last)
            at_now = np.where(inside, s.demand[rows, np.clip(index_now, 0, last)], s.demand[:, 0])
            # -inf: no target minute at the lead time (forecast expired, no sample, as recommend() says); NaN:
            # a NaN element, on which recommend() would raise: left out too
            # and older than the freshness limit: recommend()'s forecast_stale, left out
            answered = np.isfinite(at_lead) & np.isfinite(at_now) & ~(now_s - s.issued_at_s > max_age_s)
            now_replicas = replicas_for_array(at_now, s.replica_rps)
            lead_replicas = replicas_for_array(at_lead, s.replica_rps)
            for i in np.flatnonzero(answered):
                prefix_now, prefix_lead = s.prefixes[i]
                lines += (prefix_now, self._value(now_replicas[i]), prefix_lead, self._value(lead_replicas[i]))
        models = self._snapshot.models
        for model_id in s.full_path:
            view = models.get(model_id)
            if view is None:
                continue
            result = recommend(view.forecast, model_id=model_id, now=now,
                               lead_time_s=float(view.lead_time_s or self._settings.default_cold_start_s),
                               replica_rps=view.replica_rps, quantile=self._settings.recommendation_quantile,
                               max_age_s=max_age_s)
            if result.replicas_at_lead_time is not None:
                prefix_now, prefix_lead = _prefixes(model_id)
                lines += (prefix_now, self._value(float(result.replicas_now)), prefix_lead,
                          self._value(float(result.replicas_at_lead_time)))
        return "".join(lines).encode()
