"""``prewarm_recommended_replicas`` written from arrays (:mod:`api.recommendation_gauges`) is, line for line, what
prometheus_client writes for :func:`recommend`'s answer per model: any clock, forecast, lead time, replica size and
id, prepared bodies and full-path models alike, and it follows the snapshot when a run lands."""

from __future__ import annotations

from datetime import datetime, timedelta
from types import SimpleNamespace

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from api.prepared import prepare_recommendation
from api.recommendation_gauges import RecommendationGauges
from api.snapshot import ModelView
from forecaster.planning.recommendation import MinuteQuantiles, recommend
from tests.test_api_prepared import NOW, random_run

SETTINGS = SimpleNamespace(default_cold_start_s=45.0, recommendation_quantile=0.9, forecast_fresh_s=180.0)
IDS = ["llama", "model-000042", 'quo"te\\back', "ünïcødé-模型", "tab\tnew\nline", "x" * 256]


class FakeSnapshot:
    """What the gauges read of :class:`api.snapshot.ForecastSnapshot`: ``models`` and ``prepared``, made as its
    ``_prepare`` makes them (the default lead time where the latency model gave none)."""

    def __init__(self, models: dict[str, ModelView], settings=SETTINGS):
        self.models = models
        self.prepared = {
            model_id: prepare_recommendation(model_id, view.forecast,
                                             lead_time_s=float(view.lead_time_s or settings.default_cold_start_s),
                                             replica_rps=view.replica_rps, quantile=settings.recommendation_quantile,
                                             max_age_s=settings.forecast_fresh_s)
            for model_id, view in models.items()}


def reference(snapshot: FakeSnapshot, now: datetime, settings=SETTINGS) -> bytes:
    """The gauge as it was made before: recommend() per model through prometheus_client (a model whose forecast is
    stale or expired has no samples)."""

    class Collector:
        def collect(self):
            gauge = GaugeMetricFamily("prewarm_recommended_replicas",
                                      "Replicas to have ready, now and at the cold-start lead time",
                                      labels=["model_id", "at"])
            for model_id, view in snapshot.models.items():
                result = recommend(view.forecast, model_id=model_id, now=now,
                                   lead_time_s=float(view.lead_time_s or settings.default_cold_start_s),
                                   replica_rps=view.replica_rps, quantile=settings.recommendation_quantile,
                                   max_age_s=settings.forecast_fresh_s)
                if result.replicas_at_lead_time is not None:
                    gauge.add_metric([model_id, "now"], result.replicas_now)
                    gauge.add_metric([model_id, "lead_time"], result.replicas_at_lead_time)
            yield gauge

    registry = CollectorRegistry()
    registry.register(Collector())
    return generate_latest(registry)


def lines(body: bytes) -> tuple[list[bytes], list[bytes]]:
    """(comment lines in order, sample lines sorted): the sample order is not part of the format."""
    split = body.splitlines()
    return [x for x in split if x.startswith(b"#")], sorted(x for x in split if not x.startswith(b"#"))


def _prefix(model_id: str) -> bytes:
    escaped = model_id.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
    return f'prewarm_recommended_replicas{{at="now",model_id="{escaped}"}} '.encode()


def with_gaps(run: MinuteQuantiles, rng: np.random.Generator) -> MinuteQuantiles:
    """The run less some of its target minutes (NULL elements): no prepared body answers it."""
    keep = np.sort(rng.choice(len(run.minutes_s), size=max(1, len(run.minutes_s) // 2), replace=False))
    if len(keep) > 1 and run.minutes_s[keep[-1]] - run.minutes_s[keep[0]] == 60 * (len(keep) - 1):
        keep = keep[:-1] if len(keep) > 2 else keep  # still consecutive: drop one more to make a gap
    return MinuteQuantiles(issued_at=run.issued_at, model_version_id=run.model_version_id,
                           minutes_s=run.minutes_s[keep], levels=run.levels, values=run.values[keep],
                           point=run.point[keep])


def test_the_gauge_is_recommends_answer_for_any_clock_forecast_and_id():
    rng = np.random.default_rng(23)
    level_sets = [(0.1, 0.5, 0.9, 0.95, 0.99), (0.5, 0.9), (0.1, 0.5, 0.95), (0.99,), ()]
    compared = samples = full_path = stale = 0
    for fleet in range(40):
        # the default freshness limit in a third of the fleets (stale models), none to speak of in the rest
        settings = SimpleNamespace(**{**vars(SETTINGS), "forecast_fresh_s": [180.0, 1e9, 1e9][fleet % 3]})
        models = {}
        for i in range(int(rng.integers(1, 25))):
            issued_at = NOW - timedelta(seconds=float(rng.uniform(0, 4000)))
            run = None if i % 11 == 3 else random_run(rng, issued_at, level_sets[(fleet + i) % len(level_sets)])
            if run is not None and i % 7 == 5:
                run = with_gaps(run, rng)
            lead = [None, 45.0, 19.76, 0.001, 3600.0, float(rng.uniform(1, 900))][int(rng.integers(0, 6))]
            models[f"{IDS[i % len(IDS)]}-{i}"] = ModelView(replica_rps=[None, 0.0, 0.001, 2.0, 7.3][i % 5],
                                                          lead_time_s=lead, forecast=run)
        snapshot = FakeSnapshot(models, settings)
        for _ in range(5):
            now = NOW + timedelta(seconds=float(rng.uniform(-300, 4000)), microseconds=int(rng.integers(0, 10**6)))
            gauges = RecommendationGauges(snapshot, settings, lambda now=now: now)
            ours, theirs = gauges.exposition(), reference(snapshot, now, settings)
            assert lines(ours) == lines(theirs), (fleet, now)
            compared += 1
            samples += len(lines(theirs)[1])
            full_path += sum(snapshot.prepared[m] is None and _prefix(m) in ours for m in models)
            stale += sum(recommend(view.forecast, model_id=m, now=now, lead_time_s=45.0, replica_rps=None,
                                   max_age_s=settings.forecast_fresh_s).reason == "forecast_stale"
                         for m, view in models.items())
    # many samples, the full path's among them, and many models left out as stale
    assert compared == 200 and samples > 500 and full_path > 10 and stale > 100


def test_the_gauge_follows_the_snapshot_and_the_clock():
    minutes = int(NOW.timestamp()) // 60 * 60 + 60 * np.arange(60, dtype=np.int64)

    def run(level: float) -> MinuteQuantiles:
        values = np.full((60, 1), level)
        return MinuteQuantiles(issued_at=NOW, model_version_id=None, minutes_s=minutes, levels=(0.9,),
                               values=values, point=values[:, 0].copy())

    clock = {"now": NOW}
    snapshot = FakeSnapshot({"m": ModelView(replica_rps=1.0, lead_time_s=30.0, forecast=run(120.0))})
    gauges = RecommendationGauges(snapshot, SETTINGS, lambda: clock["now"])
    assert b'prewarm_recommended_replicas{at="lead_time",model_id="m"} 2.0\n' in gauges.exposition()
    fresh = FakeSnapshot({"m": ModelView(replica_rps=1.0, lead_time_s=30.0, forecast=run(300.0))})
    snapshot.models, snapshot.prepared = fresh.models, fresh.prepared  # a refresh swaps both in
    assert b'prewarm_recommended_replicas{at="lead_time",model_id="m"} 5.0\n' in gauges.exposition()
    clock["now"] = NOW + timedelta(hours=2)  # past the run's last target minute: expired, no sample
    assert gauges.exposition().count(b"\n") == 2  # HELP and TYPE only


def test_a_stale_forecast_has_no_samples():
    """A run older than PREWARM_FORECAST_FRESH_S (the forecast job stopped) is not served as current for the rest
    of its hour: its model leaves the gauge, so prometheus-adapter answers the HPA an error for it."""
    minutes = int(NOW.timestamp()) // 60 * 60 + 60 * np.arange(60, dtype=np.int64)
    values = np.full((60, 1), 120.0)
    run = MinuteQuantiles(issued_at=NOW, model_version_id=None, minutes_s=minutes, levels=(0.9,), values=values,
                          point=values[:, 0].copy())
    gappy = with_gaps(run, np.random.default_rng(1))  # no prepared body: the full path
    clock = {"now": NOW + timedelta(minutes=1)}
    snapshot = FakeSnapshot({"m": ModelView(replica_rps=1.0, lead_time_s=30.0, forecast=run),
                             "g": ModelView(replica_rps=1.0, lead_time_s=30.0, forecast=gappy)})
    assert snapshot.prepared["m"] is not None and snapshot.prepared["g"] is None
    gauges = RecommendationGauges(snapshot, SETTINGS, lambda: clock["now"])
    assert b'prewarm_recommended_replicas{at="lead_time",model_id="m"} 2.0\n' in gauges.exposition()
    clock["now"] = NOW + timedelta(minutes=10)  # inside the run's hour, older than the 180 s limit
    assert lines(gauges.exposition())[1] == []
