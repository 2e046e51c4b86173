"""The per-model cold-start horizon (``GET /v1/models/{id}/cold-start`` and the ``/metrics`` gauges) against a real
PostgreSQL: a latency model trained from stored cold starts, two nodes with caches, forecasts (the fleet of
``tests/test_lead_time.py``), and the plan job's own readers as the reference."""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pandas as pd
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text

from api.main import create_app
from forecaster.contracts.phases import START_STATES
from forecaster.jobs.planning import fleet_from_store, predicted_latency
from forecaster.planning.fleet import PlannerSettings
from forecaster.planning.lead_time import start_seconds_by_state, warmest_states
from forecaster.ingest.service import push_cold_starts
from forecaster.store.catalog import ServingModelSpec, upsert_models
from forecaster.store.forecasts import write_forecasts
from forecaster.store.tokens import create_token
from tests.test_lead_time import NOW, SIZES, fleet  # noqa: F401 - the fixture: models, nodes, caches, latency model


@pytest.fixture
def client(engine, settings, fleet):  # noqa: F811 - the imported fixture
    with engine.begin() as conn:  # registered, never forecast, never started
        upsert_models(conn, [ServingModelSpec(id="d", replica_rps=1.0)])
    token = create_token(engine, name="read", scopes=["read"])
    with TestClient(create_app(settings, engine, clock=lambda: NOW)) as client:
        client.headers["Authorization"] = f"Bearer {token}"
        yield client


def newest_totals(engine, model_id: str, cache_state: str | None = None, n: int = 20) -> np.ndarray:
    where = "model_id = :m" + ("" if cache_state is None else " AND cache_state = :s")
    rows = engine.connect().execute(text(f"SELECT total_seconds FROM cold_starts WHERE {where} "
                                         "ORDER BY started_at DESC LIMIT :n"),
                                    {"m": model_id, "s": cache_state, "n": n}).scalars().all()
    return np.array(rows)


def test_horizon_is_the_planners_prediction_and_lead(engine, settings, fleet, client):  # noqa: F811
    store_fleet = fleet_from_store(engine, now=NOW)
    reference = start_seconds_by_state(predicted_latency(engine, store_fleet, now=NOW, settings=settings),
                                       list(SIZES), store_fleet)  # the plan job's latency input, reduced per tier
    states = warmest_states(store_fleet)
    for model in SIZES:
        body = client.get(f"/v1/models/{model}/cold-start").json()
        assert [t["tier"] for t in body["tiers"]] == list(START_STATES)
        for tier in body["tiers"]:
            assert tier["predicted_s"] == pytest.approx(reference.loc[model, tier["tier"]], rel=1e-9)
        assert body["start_tier"] == states[model] and body["node_id"] is None and body["hour_utc"] == 12
        assert body["latency_model_version"] == fleet
        assert body["predicted_start_s"] == pytest.approx(reference.loc[model, states[model]], rel=1e-9)
        assert body["lead_time_s"] == pytest.approx(PlannerSettings().lead(body["predicted_start_s"]), rel=1e-12)
        recommendation = client.get(f"/v1/models/{model}/recommendation").json()
        assert body["lead_time_s"] == pytest.approx(recommendation["lead_time_s"], rel=1e-9)  # what prewarm uses
        predicted = [t["predicted_s"] for t in body["tiers"]]
        assert predicted[0] > 2 * predicted[-1]  # from nothing is far slower than from host memory


def test_observed_rolling_p90_overall_and_per_cache_state(engine, client):
    body = client.get("/v1/models/a/cold-start").json()
    newest = newest_totals(engine, "a")
    assert body["observed"] == {"p90_s": pytest.approx(float(np.percentile(newest, 90))), "n": 20}
    assert len(newest) == 20 and len(newest_totals(engine, "a", n=100)) == 30  # 30 stored, the newest 20 count
    by_state = body["observed_by_cache_state"]
    assert set(by_state) <= set(START_STATES) and len(by_state) >= 2
    for state, figure in by_state.items():
        totals = newest_totals(engine, "a", state)
        assert figure == {"p90_s": pytest.approx(float(np.percentile(totals, 90))), "n": len(totals)}
    never = client.get("/v1/models/d/cold-start").json()  # registered, nothing observed: the prediction only
    assert never["observed"] is None and never["observed_by_cache_state"] == {}
    assert never["start_tier"] == "none" and never["tiers"][0]["predicted_s"] > 0


def test_a_node_asked_about_and_the_404s(client):
    on_n1 = client.get("/v1/models/a/cold-start?node=n1").json()
    assert on_n1["node_id"] == "n1" and on_n1["start_tier"] == "disk"  # a's weights are on n1's disk
    dashboard = client.get("/v1/models/a/coldstarts?node=n1").json()
    assert on_n1["lead_time_s"] == pytest.approx(dashboard["lead_time_s"], rel=1e-9)
    on_n2 = client.get("/v1/models/a/cold-start?node=n2").json()
    assert on_n2["start_tier"] == "none" and on_n2["lead_time_s"] > on_n1["lead_time_s"]
    unknown_node = client.get("/v1/models/a/cold-start?node=n9")
    assert unknown_node.status_code == 404 and unknown_node.json()["detail"] == "unknown node 'n9'"
    unknown = client.get("/v1/models/nope/cold-start")
    assert unknown.status_code == 404 and unknown.json()["detail"] == "model 'nope' is not registered"
    assert client.get("/v1/models/a/cold-start", headers={"Authorization": ""}).status_code == 401
    assert client.get("/v1/models/a/cold-start?node=").status_code == 422


def scrape(client) -> dict[str, dict[tuple, float]]:
    families = text_string_to_metric_families(client.get("/metrics").text)
    return {f.name: {tuple(sorted(s.labels.items())): s.value for s in f.samples} for f in families
            if f.name.startswith("prewarm_cold_start")}


def test_metrics_carry_the_same_figures_for_models_with_a_forecast(client):
    gauges = scrape(client)
    for model in SIZES:
        body = client.get(f"/v1/models/{model}/cold-start").json()
        for tier in body["tiers"]:
            key = (("model_id", model), ("tier", tier["tier"]))
            assert gauges["prewarm_cold_start_predicted_seconds"][key] == pytest.approx(tier["predicted_s"])
        assert gauges["prewarm_cold_start_lead_time_seconds"][(("model_id", model),)] == pytest.approx(
            body["lead_time_s"])
        assert gauges["prewarm_cold_start_observed_p90_seconds"][(("model_id", model),)] == pytest.approx(
            body["observed"]["p90_s"])
    models = {dict(k)["model_id"] for k in gauges["prewarm_cold_start_predicted_seconds"]}
    assert models == set(SIZES)  # d has no forecast: not on /metrics
    assert len(gauges["prewarm_cold_start_predicted_seconds"]) == 4 * len(SIZES)
    assert gauges["prewarm_cold_start_metrics_models_left_out"] == {(): 0.0}


def test_metrics_follow_a_model_that_gains_a_forecast(client, engine):
    def lead_models() -> set[str]:
        return {dict(k)["model_id"] for k in scrape(client)["prewarm_cold_start_lead_time_seconds"]}

    assert lead_models() == set(SIZES)
    assert lead_models() == set(SIZES)  # the snapshot unchanged: the same models, kept
    minutes = pd.date_range(pd.Timestamp(NOW), periods=60, freq="min")
    write_forecasts(engine, pd.DataFrame({"unique_id": "d", "ds": minutes, "point": 2.0, "p_any": 0.5, "q0.1": 0.0,
                                          "q0.5": 2.0, "q0.9": 4.0}),
                    issued_at=NOW + timedelta(seconds=1), model_version_id=None)
    assert client.app.state.snapshot.refresh()
    assert lead_models() == set(SIZES) | {"d"}  # d's run landed: on /metrics at the next scrape


def test_metrics_cardinality_is_capped(engine, settings, fleet):  # noqa: F811
    capped = settings.model_copy(update={"coldstart_metrics_max_models": 2})
    with TestClient(create_app(capped, engine, clock=lambda: NOW)) as client:
        gauges = scrape(client)
    assert {dict(k)["model_id"] for k in gauges["prewarm_cold_start_lead_time_seconds"]} == {"a", "b"}
    assert gauges["prewarm_cold_start_metrics_models_left_out"] == {(): 1.0}


class _Models:
    """The part of the API's snapshot the gauges read: which models have a forecast."""

    def __init__(self, ids) -> None:
        self.newest_issued_at = NOW
        self.models = {m: type("View", (), {"forecast": object()})() for m in ids}
        self.prepared = {}  # replaced by the real snapshot whenever a forecast lands or the catalogue is read


def gauge_values(collector) -> dict[str, dict[tuple, float]]:
    return {f.name: {tuple(s.labels.values()): s.value for s in f.samples} for f in collector.collect()}


def test_metrics_are_kept_for_their_max_age_and_follow_the_models_and_the_hour(engine, settings, fleet):  # noqa: F811
    from api.metrics import ColdStartHorizonCollector

    clock, timer = [NOW], [1000.0]
    collector = ColdStartHorizonCollector(engine, _Models(SIZES), settings, lambda: clock[0], lambda: timer[0])
    first = gauge_values(collector)
    p90 = first["prewarm_cold_start_observed_p90_seconds"]
    assert first["prewarm_cold_start_metrics_age_seconds"] == {(): 0.0} and set(p90) == {("a",), ("b",), ("c",)}
    slow = [{"model_id": "a", "node_id": "n1", "started_at": (NOW - timedelta(minutes=k)).isoformat(),
             "total_seconds": 900.0, "cache_state": "none"} for k in range(1, 4)]
    push_cold_starts(engine, settings, slow, now=NOW)
    fresh = newest_totals(engine, "a")
    assert float(np.percentile(fresh, 90)) != pytest.approx(p90[("a",)])

    timer[0] += 29.0  # younger than the max age: the kept figures, with their age
    kept = gauge_values(collector)
    assert kept["prewarm_cold_start_observed_p90_seconds"] == p90
    assert kept["prewarm_cold_start_metrics_age_seconds"] == {(): 29.0}
    timer[0] += 1.0  # 30 s: computed again
    again = gauge_values(collector)
    assert again["prewarm_cold_start_metrics_age_seconds"] == {(): 0.0}
    assert again["prewarm_cold_start_observed_p90_seconds"][("a",)] == pytest.approx(float(np.percentile(fresh, 90)))

    collector._snapshot = _Models(["a", "b"])  # another set of models: at once
    assert set(gauge_values(collector)["prewarm_cold_start_lead_time_seconds"]) == {("a",), ("b",)}
    timer[0] += 1.0
    clock[0] = NOW + timedelta(minutes=59)  # the same hour: kept
    assert gauge_values(collector)["prewarm_cold_start_metrics_age_seconds"] == {(): 1.0}
    clock[0] = NOW + timedelta(hours=1)  # the latency model predicts per hour: at once
    assert gauge_values(collector)["prewarm_cold_start_metrics_age_seconds"] == {(): 0.0}

    every = ColdStartHorizonCollector(engine, _Models(SIZES), settings.model_copy(
        update={"coldstart_metrics_max_age_s": 0.0}), lambda: NOW, lambda: timer[0])
    gauge_values(every)
    push_cold_starts(engine, settings, [{**slow[0], "started_at": NOW.isoformat(), "total_seconds": 5.0}], now=NOW)
    assert gauge_values(every)["prewarm_cold_start_observed_p90_seconds"][("a",)] == pytest.approx(
        float(np.percentile(newest_totals(engine, "a"), 90)))


def test_a_failed_computation_is_not_kept(engine, settings, fleet):  # noqa: F811
    from api.metrics import ColdStartHorizonCollector
    from forecaster.store.db import make_engine

    gone = make_engine("postgresql+psycopg://nobody@127.0.0.1:9/none?connect_timeout=1")
    collector = ColdStartHorizonCollector(gone, _Models(SIZES), settings, lambda: NOW, lambda: 0.0)
    assert set(gauge_values(collector)) == {"prewarm_cold_start_metrics_models_left_out"}  # database_up says why
    collector._engine = engine  # the database is back: computed on the next scrape, not an empty kept answer
    values = gauge_values(collector)
    assert values["prewarm_cold_start_metrics_age_seconds"] == {(): 0.0}
    assert set(values["prewarm_cold_start_lead_time_seconds"]) == {("a",), ("b",), ("c",)}
    gone.dispose()


@pytest.fixture
def held(engine, settings, fleet):  # noqa: F811 - the imported fixture
    """The API snapshot's own per-node table of the whole catalogue, as its lead times computed it."""
    from api.snapshot import ForecastSnapshot

    snapshot = ForecastSnapshot(engine, refresh_s=0, settings=settings, clock=lambda: NOW)
    assert snapshot.refresh()
    assert snapshot.held_latency is not None and snapshot.held_latency.latency_model_version == fleet
    return snapshot.held_latency


def _doubled(held, **changes):
    """``held`` with every cell twice as long (so that a horizon read from it shows), and ``changes`` applied."""
    from dataclasses import replace

    from forecaster.contracts.latency import NodeLatencyTable

    t = held.table
    table = NodeLatencyTable(model_ids=t.model_ids, node_ids=t.node_ids,
                             per_node={k: v * 2 for k, v in t.per_node.items()},
                             per_model={k: v * 2 for k, v in t.per_model.items()})
    return replace(held, table=table, **changes)


@pytest.mark.parametrize("node", [None, "n1"])
def test_the_horizon_reads_the_snapshots_table_rows_and_they_are_the_latency_models(engine, settings, held, node):
    from api.coldstart_horizon import predict_horizon

    ids = list(SIZES)
    asked = predict_horizon(engine, settings, NOW, ids, node=node)
    read = predict_horizon(engine, settings, NOW, ids, node=node, held=held)
    pd.testing.assert_frame_equal(read.predicted_s, asked.predicted_s, rtol=1e-6)
    pd.testing.assert_series_equal(read.lead_time_s, asked.lead_time_s, rtol=1e-6)
    assert read.start_state.equals(asked.start_state) and read.latency_model_version == asked.latency_model_version
    doubled = predict_horizon(engine, settings, NOW, ids, node=node, held=_doubled(held))
    np.testing.assert_allclose(doubled.predicted_s.to_numpy(), 2 * asked.predicted_s.to_numpy(), rtol=1e-6)


@pytest.mark.parametrize("stale", ["hour", "champion", "nodes", "sizes", "missing"])
def test_a_held_table_that_no_longer_answers_is_not_read(engine, settings, held, stale):
    from dataclasses import replace

    from api.coldstart_horizon import predict_horizon
    from forecaster.contracts.latency import NodeLatencyTable

    ids = list(SIZES)
    if stale == "hour":
        other = _doubled(held, hour_utc=13)
    elif stale == "champion":
        other = _doubled(held, latency_model_version="latency-20000101T0000-000000")
    elif stale == "sizes":  # resized since the snapshot read the catalogue
        other = _doubled(held, sizes=held.sizes.assign(weights_bytes=held.sizes["weights_bytes"] + 1))
    else:
        other = _doubled(held)
        t = other.table
        keep = slice(None) if stale == "missing" else slice(0, len(t.node_ids) - 1)
        rows = slice(1, None) if stale == "missing" else slice(None)
        other = replace(other, table=NodeLatencyTable(
            model_ids=t.model_ids[rows], node_ids=t.node_ids[keep],
            per_node={k: v[rows][:, keep] for k, v in t.per_node.items()},
            per_model={k: v[rows] for k, v in t.per_model.items()}))
    asked = predict_horizon(engine, settings, NOW, ids)
    read = predict_horizon(engine, settings, NOW, ids, held=other)
    pd.testing.assert_frame_equal(read.predicted_s, asked.predicted_s, rtol=1e-6)
