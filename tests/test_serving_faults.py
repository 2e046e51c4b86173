"""Faults of the serving side (the API's forecast snapshot, /readyz, recommendations, KEDA's scaler) that an audit
found: a refresher thread ended by one failed refresh, a run stamped ahead of the clock hiding later runs, and
infinite, negative or huge stored forecasts crashing the answers."""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone

import pandas as pd
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import exc as sa_exc

import api.snapshot as snapshot_module
from api.main import create_app
from forecaster.store.catalog import ServingModelSpec, upsert_models
from forecaster.store.forecasts import write_forecasts
from forecaster.store.tokens import create_token
from tests.test_keda_scaler import SteppedClock

START = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)


def store_run(engine, models, issued_at: datetime, q90: float = 150.0) -> None:
    minutes = pd.date_range(pd.Timestamp(issued_at).floor("min"), periods=60, freq="min")
    write_forecasts(engine, pd.concat([pd.DataFrame({"unique_id": m, "ds": minutes, "point": q90, "p_any": 1.0,
                                                     "q0.9": q90}) for m in models]),
                    issued_at=issued_at, model_version_id=None)


@pytest.fixture
def registered(engine):
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id=m, replica_rps=2.0) for m in ("a", "b")])
    token = create_token(engine, name="r", scopes=["read"])
    return {"Authorization": f"Bearer {token}"}


# --- fault 1: the refresher thread and /readyz ------------------------------------------------------------


def test_the_snapshot_refresher_outlives_a_failed_refresh_and_readyz_fails_meanwhile(engine, settings, registered,
                                                                                       monkeypatch):
    """A pool timeout (sqlalchemy.exc.TimeoutError, not an OperationalError) ended the refresher thread for good:
    every recommendation then read forecast_stale until a restart, while /readyz (the database's newest run)
    said ready."""
    clock = SteppedClock(START + timedelta(seconds=30))
    store_run(engine, ("a", "b"), START)
    settings = settings.model_copy(update={"api_snapshot_refresh_s": 0.05})
    real = snapshot_module._newer_runs
    failing = {"on": False}

    def newer_runs(*args, **kwargs):
        if failing["on"]:
            raise sa_exc.TimeoutError("QueuePool limit of size 5 overflow 5 reached, connection timed out")
        return real(*args, **kwargs)

    monkeypatch.setattr(snapshot_module, "_newer_runs", newer_runs)
    with TestClient(create_app(settings, engine, clock=clock)) as client:
        assert client.get("/readyz").status_code == 200
        failing["on"] = True
        time.sleep(0.5)  # several refreshes fail
        ready = client.get("/readyz")
        assert ready.status_code == 503, ready.json()
        assert "TimeoutError" in ready.json()["checks"]["snapshot"]
        body = client.get("/v1/models/a/recommendation", headers=registered).json()
        assert body["stale"] is True and body["reason"] == "forecast"  # what is held, marked stale
        failing["on"] = False
        store_run(engine, ("a", "b"), START + timedelta(minutes=1))
        clock.now = START + timedelta(minutes=1, seconds=30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            body = client.get("/v1/models/a/recommendation", headers=registered).json()
            if body["forecast_issued_at"].startswith("2026-11-29T12:01"):
                break
            time.sleep(0.05)
        assert body["forecast_issued_at"].startswith("2026-11-29T12:01") and body["stale"] is False, body
        assert client.get("/readyz").status_code == 200


def test_readyz_reads_this_processs_snapshot_not_the_database(engine, settings, registered, monkeypatch):
    """Runs in the database do not make a process ready whose own snapshot cannot load them."""
    clock = SteppedClock(START + timedelta(seconds=30))
    store_run(engine, ("a", "b"), START)

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in loading runs")

    with TestClient(create_app(settings, engine, clock=clock)) as client:
        assert client.get("/readyz").status_code == 200
        monkeypatch.setattr(snapshot_module, "_newer_runs", broken)
        ready = client.get("/readyz")
        assert ready.status_code == 503 and "RuntimeError" in ready.json()["checks"]["snapshot"]


# --- fault 2: a run stamped ahead of the clock --------------------------------------------------------------


def test_a_run_stamped_ahead_of_the_clock_hides_no_later_runs_and_keeps_nothing_ready(engine, settings,
                                                                                        registered):
    """A scheduler whose clock was 30 minutes ahead wrote one run for model a, then its clock was stepped back:
    the snapshot loaded only runs issued after that run (for every model), and /readyz read it as fresh."""
    clock = SteppedClock(START + timedelta(seconds=30))
    with TestClient(create_app(settings, engine, clock=clock)) as client:
        def rec(model):
            return client.get(f"/v1/models/{model}/recommendation", headers=registered).json()

        store_run(engine, ("a", "b"), START - timedelta(seconds=10))
        assert rec("a")["reason"] == "forecast"
        store_run(engine, ("a",), START + timedelta(minutes=30), q90=9999.0)  # the clock-ahead run
        assert rec("a")["forecast_issued_at"].startswith("2026-11-29T11:59:50")  # not loaded: 30 min ahead
        for k in range(1, 6):
            store_run(engine, ("a", "b"), START + timedelta(minutes=k), q90=450.0)
        clock.now = START + timedelta(minutes=5, seconds=30)
        for model in ("a", "b"):
            body = rec(model)
            assert body["reason"] == "forecast" and body["forecast_issued_at"].startswith("2026-11-29T12:05"), body
            assert body["demand_now_per_min"] == 450.0
        assert client.get("/readyz").status_code == 200
        clock.now = START + timedelta(minutes=15)  # the forecast job stopped: only the clock-ahead run is "new"
        ready = client.get("/readyz")
        assert ready.status_code == 503 and ready.json()["checks"]["forecast_age_s"] == 600.0, ready.json()


def test_a_run_a_little_ahead_is_served_and_hides_no_other_models_later_run(engine, settings, registered):
    clock = SteppedClock(START + timedelta(seconds=30))
    with TestClient(create_app(settings, engine, clock=clock)) as client:
        def issued(model):
            return client.get(f"/v1/models/{model}/recommendation", headers=registered).json()["forecast_issued_at"]

        store_run(engine, ("a",), START + timedelta(seconds=50))  # 20 s ahead of the API's clock: within tolerance
        assert issued("a").startswith("2026-11-29T12:00:50")
        clock.now = START + timedelta(minutes=1)
        store_run(engine, ("b",), START + timedelta(seconds=45))  # issued before a's run (clock ahead), written after
        assert issued("b").startswith("2026-11-29T12:00:45")
        assert issued("a").startswith("2026-11-29T12:00:50")


def test_a_run_a_little_ahead_is_prepared_once_not_on_every_refresh(engine, settings, registered, monkeypatch):
    """A run stamped within the tolerance ahead of the API's clock is read again until the clock passes it (the
    cursor stops at the clock); each re-read used to reload the catalogue and re-prepare the whole fleet, every
    refresh (a second of the GIL at 100,000 models)."""
    now = START + timedelta(minutes=5)
    store_run(engine, ("a", "b"), now - timedelta(seconds=40))
    snapshot = snapshot_module.ForecastSnapshot(engine, refresh_s=5.0, settings=settings, clock=lambda: now)
    snapshot.refresh()
    store_run(engine, ("a",), now + timedelta(seconds=20))
    prepared = []
    real = snapshot_module.ForecastSnapshot._prepare
    monkeypatch.setattr(snapshot_module.ForecastSnapshot, "_prepare",
                        lambda self, *args, **kwargs: prepared.append(1) or real(self, *args, **kwargs))
    for _ in range(5):
        snapshot.refresh()
    assert len(prepared) == 1
    assert snapshot.models["a"].forecast.issued_at == now + timedelta(seconds=20)
