"""Test (d): the API's lead time for a model is the latency model's prediction, the one the planner acts on.

Real PostgreSQL, a latency model trained from stored cold starts and transfers and saved in the registry, the
API app, and the plan job's own readers (``fleet_from_store``, ``predicted_latency``, ``stored_forecast``).
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import numpy as np
import pandas as pd
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text

from api.main import create_app
from api.snapshot import planner_settings_for
from forecaster.coldstart.physics import phase_seconds
from forecaster.coldstart.service import train_latency_model
from forecaster.contracts.actions import ActionKind
from forecaster.contracts.phases import PHASES
from forecaster.ingest.service import push_cold_starts, push_transfers
from forecaster.jobs.planning import fleet_from_store, predicted_latency, stored_forecast
from forecaster.planning.fleet import PlannerSettings, node_latency
from forecaster.planning.lead_time import lead_time_s, warmest_states
from forecaster.planning.planner import plan
from forecaster.store.catalog import ServingModelSpec, upsert_models
from forecaster.store.forecasts import write_forecasts
from forecaster.store.tokens import create_token

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)
SMALL_TREES = {"n_estimators": 60, "learning_rate": 0.1, "num_leaves": 7, "min_child_samples": 5}
SIZES = {"a": (10e9, 16e9), "b": (9e9, 1e9), "c": (12e9, 40e9)}  # image, weights bytes
SPIKE_MIN = 8  # demand appears 8 minutes after now


@pytest.fixture
def fleet(engine, settings):
    """Three models; a's weights on disk at n1, b's image at n2, c cached nowhere; cold starts, transfers, forecasts."""
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id=m, image_ref=f"reg.example/{m}:1", image_size_bytes=int(i),
                                              weights_uri=f"s3://w/{m}", weights_size_bytes=int(w), replica_rps=2.0)
                             for m, (i, w) in SIZES.items()])
        for node in ("n1", "n2"):
            conn.execute(text("INSERT INTO nodes (id, gpus_total, gpus_free) VALUES (:n, 8, 8)"), {"n": node})
        conn.execute(text("INSERT INTO node_cache (node_id, artefact_kind, ref, tier) VALUES "
                          "('n1', 'weights', 's3://w/a', 'disk'), ('n1', 'image', 'reg.example/a:1', 'image'), "
                          "('n2', 'image', 'reg.example/b:1', 'image')"))
    rng = np.random.default_rng(0)
    events = []
    for k in range(90):
        model = ("a", "b", "c")[k % 3]
        state = int(rng.integers(0, 4))
        when = NOW - timedelta(days=2) + timedelta(minutes=31 * k)
        image, weights = SIZES[model]
        phases = phase_seconds(np.array([image]), np.array([weights]), np.array([state]), hour=when.hour)
        values = {p: float(phases[p][0]) * float(rng.lognormal(0.2, 0.1)) for p in PHASES}
        events.append({"model_id": model, "node_id": f"n{k % 2 + 1}", "started_at": when.isoformat(),
                       "total_seconds": sum(values.values()), **values,
                       "cache_state": ("none", "image", "disk", "host")[state]})
    push_cold_starts(engine, settings, events, now=NOW)
    push_transfers(engine, settings, [
        {"kind": "prepull", "model_id": "b", "node_id": "n2", "ref": "reg.example/b:1", "bytes": int(9e9),
         "started_at": (NOW - timedelta(hours=k)).isoformat(), "seconds": 90.0, "image_pull_s": 90.0}
        for k in range(1, 6)], now=NOW)
    version = train_latency_model(engine, settings, NOW, tree_params=SMALL_TREES)
    start = pd.Timestamp(NOW)
    minutes = pd.date_range(start, periods=60, freq="min")
    for model in SIZES:
        demand = np.where(np.arange(60) >= SPIKE_MIN, 500.0, 0.0)
        write_forecasts(engine, pd.DataFrame({
            "unique_id": model, "ds": minutes, "point": demand, "p_any": (demand > 0).astype(float),
            "q0.1": demand * 0.8, "q0.5": demand, "q0.9": demand * 1.2}), issued_at=NOW, model_version_id=None)
    return version


def test_the_api_lead_time_is_the_latency_models_prediction_the_planner_uses(engine, settings, fleet):
    # the plan job's path: its fleet builder and its latency input
    store_fleet = fleet_from_store(engine, now=NOW)
    latency = predicted_latency(engine, store_fleet, now=NOW, settings=settings)
    states = warmest_states(store_fleet)
    assert states.to_dict() == {"a": "disk", "b": "image", "c": "none"}
    assert set(latency.node_ids) == {"n1", "n2"}  # the plan job asks per node of the fleet (a NodeLatencyTable)
    expected = lead_time_s(latency, states, planner_settings_for(settings), fleet=store_fleet)
    by_state = node_latency(latency, store_fleet).set_index(["model_id", "state"])["total_s"]
    for model, state in states.items():  # the lead is the planner's margins on the model's predicted total
        assert expected[model] == pytest.approx(PlannerSettings().lead(by_state[(model, state)]), rel=1e-12)
    assert expected["c"] > expected["a"] and len(set(expected.round(3))) == 3

    token = create_token(engine, name="read", scopes=["read"])
    with TestClient(create_app(settings, engine, clock=lambda: NOW)) as client:
        client.headers["Authorization"] = f"Bearer {token}"
        for model in SIZES:
            body = client.get(f"/v1/models/{model}/recommendation").json()
            assert body["lead_time_s"] == pytest.approx(expected[model], rel=1e-9), model
            dash = client.get(f"/v1/models/{model}/coldstarts").json()
            assert (dash["lead_time_source"], dash["latency_model_version"], dash["lead_time_start_state"]) == (
                "latency_model", fleet, states[model])
            assert dash["lead_time_s"] == pytest.approx(expected[model], rel=1e-9)
            assert dash["observed_median_s"] is not None and dash["observed_median_s"] != dash["lead_time_s"]

    # and the planner acts on that lead: each model's scale-up starts its lead time before the spike
    forecast = stored_forecast(engine, now=NOW, horizon_min=settings.plan_horizon_min)
    planned = plan(forecast, latency, store_fleet, PlannerSettings(horizon_min=settings.plan_horizon_min,
                                                                   tiers=False), NOW)
    first_scale = {}
    for action in planned.actions:
        if action.kind is ActionKind.SCALE:
            first_scale.setdefault(action.model_id, action)
    assert set(first_scale) == set(SIZES)
    for model, action in first_scale.items():
        started_before_spike = SPIKE_MIN * 60.0 - (action.not_before - NOW).total_seconds()
        assert started_before_spike == pytest.approx(expected[model], abs=1e-3), model


def test_the_api_answers_for_a_node(engine, settings, fleet):
    """``?node=``: the lead of a start on that node from the state it holds; an unknown node is a 404."""
    store_fleet = fleet_from_store(engine, now=NOW)
    latency = predicted_latency(engine, store_fleet, now=NOW, settings=settings)
    by = latency.to_frame().set_index(["model_id", "node_id", "state"])["total_s"]
    lead = planner_settings_for(settings).lead
    token = create_token(engine, name="read", scopes=["read"])
    with TestClient(create_app(settings, engine, clock=lambda: NOW)) as client:
        client.headers["Authorization"] = f"Bearer {token}"
        on_n1 = client.get("/v1/models/a/coldstarts", params={"node": "n1"}).json()
        on_n2 = client.get("/v1/models/a/coldstarts", params={"node": "n2"}).json()
        assert (on_n1["node_id"], on_n1["lead_time_start_state"]) == ("n1", "disk")  # a's weights on n1's disk
        assert (on_n2["node_id"], on_n2["lead_time_start_state"]) == ("n2", "none")
        assert on_n1["lead_time_s"] == pytest.approx(float(lead(by[("a", "n1", "disk")])), rel=1e-9)
        assert on_n2["lead_time_s"] == pytest.approx(float(lead(by[("a", "n2", "none")])), rel=1e-9)
        assert on_n2["lead_time_s"] > on_n1["lead_time_s"]
        assert client.get("/v1/models/a/coldstarts").json()["node_id"] is None
        missing = client.get("/v1/models/a/coldstarts", params={"node": "n9"})
        assert missing.status_code == 404 and "unknown node" in missing.text
        assert client.get("/v1/models/a/coldstarts", params={"node": ""}).status_code == 422
