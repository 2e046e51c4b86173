"""Infinite, negative or huge stored forecasts on the serving side: an explicit reason (REST) or
FAILED_PRECONDITION (KEDA), a capped replica count, never a 500, gRPC UNKNOWN or a silent 0."""

from __future__ import annotations

from datetime import timedelta

import grpc
import numpy as np
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text

from api.keda_scaler import METRIC_NAME
from api.main import create_app
from api.proto import externalscaler_pb2 as pb
from forecaster.planning.recommendation import MinuteQuantiles, recommend
from forecaster.store.catalog import ServingModelSpec, upsert_models
from tests import test_serving_faults
from tests.test_keda_scaler import SteppedClock, _served_stub, ref, status_of
from tests.test_serving_faults import START, store_run

registered = test_serving_faults.registered  # the fixture: a read token, models a and b registered


# --- fault 4: infinite, negative or huge stored forecasts ----------------------------------------------------


def corrupt(engine, model: str, value: str) -> None:
    """What the store now refuses, written around it (a run stored before, or a manual fix)."""
    with engine.begin() as conn:
        conn.execute(text("UPDATE forecasts SET quantiles = array_fill(CAST(:v AS real), "
                          "ARRAY[array_length(quantiles, 1), array_length(quantiles, 2)]), "
                          "point = array_fill(CAST(:v AS real), ARRAY[cardinality(point)]) WHERE model_id = :m"),
                     {"v": value, "m": model})


@pytest.mark.parametrize(("value", "reason"), [("Infinity", "forecast_invalid"), ("-5", "forecast_invalid"),
                                               ("3e38", "replicas_capped")])
def test_unusable_stored_runs_answer_an_explicit_reason_never_500(engine, settings, registered, value, reason):
    clock = SteppedClock(START + timedelta(seconds=30))
    store_run(engine, ("a", "b"), START)
    corrupt(engine, "a", value)
    with TestClient(create_app(settings, engine, clock=clock), raise_server_exceptions=False) as client:
        response = client.get("/v1/models/a/recommendation", headers=registered)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["reason"] == reason, body
        if reason == "replicas_capped":
            assert body["replicas_now"] == body["replicas_at_lead_time"] == 2**31 - 1
        else:
            assert body["replicas_now"] is None and body["replicas_at_lead_time"] is None
        assert client.get("/v1/models/b/recommendation", headers=registered).json()["reason"] == "forecast"


@pytest.mark.parametrize("value", ["Infinity", "-5"])
def test_keda_answers_failed_precondition_for_an_unusable_run_never_unknown_or_zero(engine, settings, value):
    clock = SteppedClock(START + timedelta(seconds=30))
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id="a", replica_rps=2.0)])
    store_run(engine, ("a",), START)
    corrupt(engine, "a", value)
    for stub in _served_stub(engine, settings, clock):
        for name, call in {
            "GetMetrics": lambda: stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=ref(model="a"),
                                                                       metricName=METRIC_NAME), timeout=10),
            "IsActive": lambda: stub.IsActive(ref(model="a"), timeout=10),
        }.items():
            got, details = status_of(call)
            assert got == grpc.StatusCode.FAILED_PRECONDITION and "infinite, NaN or negative" in details, (name, got)


def test_keda_caps_a_huge_floor_instead_of_overflowing_int64(engine, settings):
    clock = SteppedClock(START + timedelta(seconds=30))
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id="a", replica_rps=2.0)])
    store_run(engine, ("a",), START)
    corrupt(engine, "a", "3e38")
    for stub in _served_stub(engine, settings, clock):
        reply = stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=ref(model="a"), metricName=METRIC_NAME),
                                timeout=10)
        assert reply.metricValues[0].metricValue == 2**31 - 1
        assert stub.IsActive(ref(model="a"), timeout=10).result is True


def test_recommend_refuses_infinite_and_negative_demand_and_caps_replicas():
    def run(value: float) -> MinuteQuantiles:
        minutes = START.timestamp() + 60 * np.arange(10)
        return MinuteQuantiles(START, None, minutes.astype("int64"), (0.9,), np.full((10, 1), value),
                               np.full(10, value))

    now = START + timedelta(seconds=30)
    for value in (np.inf, -1.0, np.nan):
        assert recommend(run(value), model_id="m", now=now, lead_time_s=60, replica_rps=1.0).reason == \
            "forecast_invalid"
    capped = recommend(run(1e30), model_id="m", now=now, lead_time_s=60, replica_rps=1.0)
    assert capped.reason == "replicas_capped" and capped.replicas_at_lead_time == 2**31 - 1
    assert recommend(run(0.0), model_id="m", now=now, lead_time_s=60, replica_rps=1.0).replicas_now == 0
