"""Prometheus metrics of the service: API latency, forecast age and error, job durations, actions taken and open."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from sqlalchemy import Engine, text
from sqlalchemy.exc import OperationalError

from api.recommendation_gauges import RecommendationGauges
from forecaster.planning.budget import BUDGET_STATUSES, BudgetState
from forecaster.store.actions import FINISHED, action_counts
from forecaster.store.dashboard import FleetHourError, PAnyBand, fleet_hour_errors, newest_scored_hour, p_any_bands
from forecaster.store.job_runs import LATEST_JOB_RUNS_SQL


class StoreCollector:
    """Reads what the store says at scrape time, so every replica of the API reports the same."""

    def __init__(self, engine: Engine, clock: Callable[[], datetime]) -> None:
        self._engine = engine
        self._clock = clock
        #: the newest scored hour's fleet errors and p_any bands, keyed on (hour, scored_at): read again only when
        #: the scoring job has scored a newer hour or re-scored this one
        self._errors: tuple[tuple[datetime, datetime] | None, list[FleetHourError], list[PAnyBand]] = (None, [], [])

    def _fleet_errors(self, conn) -> tuple[list[FleetHourError], list[PAnyBand]]:
        key = newest_scored_hour(conn)
        if key is None:
            return [], []
        if key != self._errors[0]:
            self._errors = (key, fleet_hour_errors(conn, hour=key[0]), p_any_bands(conn, hour=key[0]))
        return self._errors[1], self._errors[2]

    def collect(self):
        up = GaugeMetricFamily("prewarm_database_up", "1 when the database answered this scrape")
        try:
            with self._engine.connect() as conn:
                newest = conn.execute(text("SELECT max(issued_at) FROM forecasts")).scalar()
                jobs = conn.execute(text(LATEST_JOB_RUNS_SQL)).all()
                actions = action_counts(conn)  # kept where actions are written, not counted per scrape
                newest_plan = conn.execute(text("SELECT (summary->>'skipped')::int, summary->'budget' FROM plans "
                                                "ORDER BY planned_at DESC, id DESC LIMIT 1")).first()
                errors, bands = self._fleet_errors(conn)
        except OperationalError:
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        age = GaugeMetricFamily("prewarm_forecast_age_seconds", "Age of the newest stored forecast")
        if newest is not None:
            age.add_metric([], (self._clock() - newest).total_seconds())
        yield age
        duration = GaugeMetricFamily("prewarm_job_last_duration_seconds", "Duration of each job's last run",
                                     labels=["job", "status"])
        for name, status, seconds in jobs:
            duration.add_metric([name, status], float(seconds or 0.0))
        yield duration
        yield from action_metrics(actions)
        left_out = GaugeMetricFamily("prewarm_plan_skipped_models",
                                     "Models the newest plan left out because a value was unusable (see the plan's "
                                     "summary and the plan job's log for which and why)")
        skipped, budget = newest_plan if newest_plan is not None else (None, None)
        if skipped is not None:
            left_out.add_metric([], float(skipped))
        yield left_out
        # the newest plan's state only: with budget mode switched off the metrics go, as the plan's state does
        yield from budget_metrics(None if budget is None else BudgetState.from_dict(budget))
        yield from forecast_error_metrics(errors, bands)


def action_metrics(counts: list[tuple[str, str, int, int]]):
    """The actions of :func:`forecaster.store.actions.action_counts` as a counter of those that finished, by kind
    and final status (deleted ones included: it never falls, as Prometheus' ``rate`` needs), and a gauge of those
    pending or running now. A status moves from the gauge to the counter when the action finishes."""
    finished = CounterMetricFamily("prewarm_actions", "Pre-warm actions finished, by kind and final status "
                                   "(succeeded, failed, dropped); those deleted by retention included",
                                   labels=["kind", "status"])
    open_now = GaugeMetricFamily("prewarm_actions_open", "Pre-warm actions pending or running now, by kind and status",
                                 labels=["kind", "status"])
    for kind, status, n, pruned in counts:
        if status in FINISHED:
            finished.add_metric([kind, status], n + pruned)
        elif n:
            open_now.add_metric([kind, status], n)
    yield finished
    yield open_now


def forecast_error_metrics(errors: list[FleetHourError], bands: list[PAnyBand]):
    """The fleet's forecast error over the newest hour the error rollup scored, per horizon, and ``p_any``'s
    reliability per band of the model-hours' mean ``p_any``: what the alerts ``PrewarmForecastErrorRising`` and
    ``PrewarmPAnyMiscalibrated`` (deploy/prometheus-rules.yml) watch.

    Each scrape repeats the same hour's figures until the next hour is scored, so an ``avg_over_time`` over a
    few hours averages those hours (each weighed by the scrapes it was newest for, about an hour each)."""
    hour = GaugeMetricFamily("prewarm_forecast_error_hour_timestamp_seconds",
                             "Start of the newest hour the forecast-error rollup scored (Unix seconds)")
    families = {
        "models": GaugeMetricFamily("prewarm_forecast_error_models",
                                    "Models scored in that hour", labels=["horizon_min"]),
        "wmape": GaugeMetricFamily("prewarm_forecast_wmape",
                                   "Fleet wMAPE of the point forecast made horizon_min minutes ahead, over that "
                                   "hour: sum of |forecast - count| over the sum of counts, every model pooled",
                                   labels=["horizon_min"]),
        "brier_any": GaugeMetricFamily("prewarm_forecast_p_any_brier",
                                       "Brier score of p_any (the probability of any request in a minute) "
                                       "against whether one came, over every scored model-minute of that hour",
                                       labels=["horizon_min"]),
        "p_any_mean": GaugeMetricFamily("prewarm_forecast_p_any_mean",
                                        "Mean p_any over those model-minutes", labels=["horizon_min"]),
        "invoked_share": GaugeMetricFamily("prewarm_forecast_invoked_share",
                                           "Share of those model-minutes with a request (what a calibrated "
                                           "p_any averages to)", labels=["horizon_min"]),
    }
    for row in errors:
        label = [str(row.horizon_min)]
        families["models"].add_metric(label, row.models)
        for name in ("wmape", "brier_any", "p_any_mean", "invoked_share"):
            value = getattr(row.error, name)
            if value is not None:  # no counts or no p_any scored in the hour: the series is absent, not 0
                families[name].add_metric(label, value)
    if errors:
        hour.add_metric([], errors[0].hour.timestamp())
    yield hour
    yield from families.values()
    labels = ["horizon_min", "p_any_band"]
    band_families = {
        "p_any_minutes": GaugeMetricFamily("prewarm_forecast_p_any_band_minutes",
                                           "Model-minutes with a p_any in that hour, of the models whose mean p_any "
                                           "over the hour falls in the band", labels=labels),
        "p_any_mean": GaugeMetricFamily("prewarm_forecast_p_any_band_mean", "Mean p_any over those model-minutes",
                                        labels=labels),
        "invoked_share": GaugeMetricFamily("prewarm_forecast_p_any_band_invoked_share",
                                           "Share of those model-minutes with a request", labels=labels),
    }
    for band in bands:
        for name, family in band_families.items():
            family.add_metric([str(band.horizon_min), band.band], getattr(band, name))
    yield from band_families.values()


def budget_metrics(state: BudgetState | None):
    """Budget mode's newest controller state (nothing before its first update): the factor, the pacing window's
    spend over its allowance, the status (1 for the current one), and spend and allowance since the state began."""
    if state is None or not state.updates:
        return
    factor = GaugeMetricFamily("prewarm_waste_budget_factor", "Budget mode's multiplier on every model's cold cost")
    factor.add_metric([], state.factor)
    yield factor
    ratio = GaugeMetricFamily("prewarm_waste_budget_window_spent_ratio",
                              "Discounted idle GPU-seconds over the discounted allowance of the pacing window "
                              "(above 1.05 the status leaves on_budget)")
    if state.allowed > 0:
        ratio.add_metric([], state.spent / state.allowed)
    yield ratio
    status = GaugeMetricFamily("prewarm_waste_budget_status", "1 for budget mode's current status",
                               labels=["status"])
    for name in BUDGET_STATUSES:
        status.add_metric([name], 1.0 if state.status == name else 0.0)
    yield status
    idle = CounterMetricFamily("prewarm_waste_budget_idle_gpu_seconds",
                               "Idle GPU-seconds spent and allowed since budget mode's state began",
                               labels=["kind"])
    idle.add_metric(["spent"], state.spent_total)
    idle.add_metric(["allowed"], state.allowed_total)
    yield idle


class ColdStartHorizonCollector:
    """Per model: the latency model's predicted cold-start seconds per tier, the lead time prewarm acts on, and the
    observed rolling p90 (:mod:`api.coldstart_horizon`, the numbers of ``GET /v1/models/{id}/cold-start``).

    Cardinality is bounded: only models with a forecast in the API's snapshot, at most
    ``PREWARM_COLDSTART_METRICS_MAX_MODELS`` (default 1,000) of them in id order, so at most 6 series per model
    (4 tiers, the lead time, the p90); ``prewarm_cold_start_metrics_models_left_out`` counts the rest.

    The figures are computed at most every ``PREWARM_COLDSTART_METRICS_MAX_AGE_S`` (default 30 s) and served from
    the last computation in between, sooner when the set of models or the UTC hour changes: at 1,000 models on 160
    nodes one computation takes 0.2 s of the API worker with the snapshot's latency table at hand, 0.6 s without
    (``bench/coldstart_reads.py``), and Prometheus pairs scraping every 15 s would pay it several times a minute
    for figures that move with caches and cold starts, not by the second. ``prewarm_cold_start_metrics_age_seconds`` says how old the served figures are. A failed
    computation is not kept: the next scrape tries again.
    """

    def __init__(self, engine: Engine, snapshot, settings, clock: Callable[[], datetime],
                 timer: Callable[[], float] = time.monotonic) -> None:
        self._engine = engine
        self._snapshot = snapshot
        self._settings = settings
        self._clock = clock
        self._timer = timer
        self._lock = threading.Lock()  # concurrent scrapes wait for one computation instead of each making one
        #: (key: the models and the UTC hour, computed at (timer), the three families' samples)
        self._kept: tuple[tuple, float, tuple[list, list, list]] | None = None
        self._ids: tuple[dict, list[str]] | None = None  # (the snapshot's prepared dict, its forecast ids)

    def _samples(self, ids: list[str]) -> tuple[list, list, list] | None:
        """``(predicted, lead, observed)`` as ``(labels, value)`` pairs; None when the database did not answer."""
        from api.coldstart_horizon import observed_p90, predict_horizon
        from forecaster.contracts.phases import START_STATES

        try:
            horizon = predict_horizon(self._engine, self._settings, self._clock(), ids,
                                      held=getattr(self._snapshot, "held_latency", None))
            recent = observed_p90(self._engine, ids)
        except OperationalError:
            return None  # prewarm_database_up says why
        seconds = horizon.predicted_s.to_numpy()
        predicted, lead = [], []
        for i, model_id in enumerate(horizon.predicted_s.index):
            for j, tier in enumerate(START_STATES):
                predicted.append(([model_id, tier], float(seconds[i, j])))
            lead.append(([model_id], float(horizon.lead_time_s.iloc[i])))
        observed = [([str(m)], float(p90)) for m, p90 in zip(recent["model_id"], recent["seconds"])]
        return predicted, lead, observed

    def _current(self, ids: list[str]) -> tuple[float, tuple[list, list, list]] | None:
        """The age (seconds) and samples to serve: the kept ones while young enough, else computed now."""
        key = (tuple(ids), self._clock().astimezone(timezone.utc).replace(minute=0, second=0, microsecond=0))
        with self._lock:
            kept = self._kept
            if kept is not None and kept[0] == key:
                age = self._timer() - kept[1]
                if 0 <= age < self._settings.coldstart_metrics_max_age_s:
                    return age, kept[2]
            samples = self._samples(ids)
            if samples is None:
                self._kept = None
                return None
            self._kept = (key, self._timer(), samples)
            return 0.0, samples

    def _forecast_ids(self) -> list[str]:
        """The snapshot's models with a forecast, in id order; sorted again only when the snapshot changed.

        The snapshot replaces (never mutates) its ``prepared`` dict whenever a forecast run lands or the catalogue
        is read again, the only two ways a model gains or loses a forecast, so its identity keys the list: at
        100,000 models sorting them took most of a scrape that served kept figures.
        """
        prepared = self._snapshot.prepared  # read before the models: a swap in between only sorts again next time
        held = self._ids
        if held is not None and held[0] is prepared:
            return held[1]
        ids = sorted(m for m, view in list(self._snapshot.models.items()) if view.forecast is not None)
        self._ids = (prepared, ids)  # holds the dict, so its id cannot be reused while kept
        return ids

    def collect(self):
        from api.coldstart_horizon import OBSERVED_QUANTILE
        from forecaster.store.coldstarts import RECENT_COLD_STARTS

        if self._snapshot.newest_issued_at is None:
            self._snapshot.refresh_if_due()
        forecast = self._forecast_ids()
        cap = self._settings.coldstart_metrics_max_models
        ids = forecast[:cap]
        left_out = GaugeMetricFamily("prewarm_cold_start_metrics_models_left_out",
                                     "Models with a forecast left out of the prewarm_cold_start_* gauges "
                                     "(PREWARM_COLDSTART_METRICS_MAX_MODELS)")
        left_out.add_metric([], float(len(forecast) - len(ids)))
        yield left_out
        families = (
            GaugeMetricFamily("prewarm_cold_start_predicted_seconds",
                              "Latency model's predicted cold-start seconds of a new replica, per start tier "
                              "(none, image, disk, host)", labels=["model_id", "tier"]),
            GaugeMetricFamily("prewarm_cold_start_lead_time_seconds",
                              "Lead time prewarm acts on: the predicted start from the model's warmest cached "
                              "tier plus the planner's margins", labels=["model_id"]),
            GaugeMetricFamily("prewarm_cold_start_observed_p90_seconds",
                              f"Rolling p{OBSERVED_QUANTILE * 100:g} of the newest {RECENT_COLD_STARTS} "
                              "stored cold starts", labels=["model_id"]),
        )
        if ids:
            current = self._current(ids)
            if current is None:
                return
            age_s, samples = current
            age = GaugeMetricFamily("prewarm_cold_start_metrics_age_seconds",
                                    "Seconds since the prewarm_cold_start_* figures were computed "
                                    "(PREWARM_COLDSTART_METRICS_MAX_AGE_S)")
            age.add_metric([], age_s)
            yield age
            for family, pairs in zip(families, samples, strict=True):
                for labels, value in pairs:
                    family.add_metric(labels, value)
        yield from families


class ServiceMetrics:
    def __init__(self, engine: Engine, clock: Callable[[], datetime], snapshot=None, settings=None) -> None:
        self.registry = CollectorRegistry()
        self.request_seconds = Histogram(
            "prewarm_api_request_seconds", "API request latency", ["method", "route", "status"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5), registry=self.registry)
        self.registry.register(StoreCollector(engine, clock))
        #: prewarm_recommended_replicas, two samples per model: written from arrays, not through the registry
        #: (api/recommendation_gauges.py); None without a snapshot or with PREWARM_RECOMMENDATION_METRICS=false
        wanted = snapshot is not None and (settings is None or settings.recommendation_metrics)
        self.recommendations = RecommendationGauges(snapshot, settings, clock) if wanted else None
        if snapshot is not None:
            self.registry.register(ColdStartHorizonCollector(engine, snapshot, settings, clock))

    def exposition(self) -> bytes:
        """The whole ``/metrics`` body (text format 0.0.4)."""
        body = generate_latest(self.registry)
        return body if self.recommendations is None else body + self.recommendations.exposition()


class LatencyMiddleware:
    """Pure ASGI middleware timing every HTTP request by route template (cheaper than BaseHTTPMiddleware)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = {"code": 500}

        async def send_and_note(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", "unmatched")
            scope["app"].state.metrics.request_seconds.labels(scope["method"], path, str(status["code"])).observe(
                time.perf_counter() - started)
