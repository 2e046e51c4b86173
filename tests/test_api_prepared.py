"""The autoscalers' read path: prepared bodies, the hot path, cached tokens and their revocation, worker processes.

The prepared bytes (:mod:`api.prepared`) must be what the schema serialises
for :func:`recommend`'s answer, for any clock, forecast and id; the hot path
(:mod:`api.hotpath`) must answer exactly as the route does and give way to it
whenever it cannot; a token revoked in this process or announced by the
database must be refused at once although verified a moment before; and
``prewarm serve`` with several workers must have each load and refresh its own
snapshot.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import numpy as np
import pandas as pd
import psutil
import pytest
from fastapi.testclient import TestClient
from pydantic import TypeAdapter

from api.main import create_app
from api.prepared import prepare_recommendation
from api.schemas import RecommendationPublic
from forecaster.planning.recommendation import MinuteQuantiles, recommend
from forecaster.settings import SettingsError, load_settings
from forecaster.store.catalog import ServingModelSpec, upsert_models
from forecaster.store.forecasts import write_forecasts
from forecaster.store.tokens import create_token, revoke_in_database, revoke_token
from tests.runtime_fixtures import stop_process

REPO = Path(__file__).resolve().parent.parent
NOW = datetime(2026, 11, 29, 12, 0, 30, tzinfo=timezone.utc)
SCHEMA = TypeAdapter(RecommendationPublic)


def schema_bytes(forecast, *, model_id, now, lead_time_s, replica_rps, quantile, stale, max_age_s=None) -> bytes:
    """What FastAPI sends for the route's answer: the response model's JSON of recommend()'s result."""
    result = recommend(forecast, model_id=model_id, now=now, lead_time_s=lead_time_s, replica_rps=replica_rps,
                       quantile=quantile, max_age_s=max_age_s)
    return SCHEMA.dump_json(RecommendationPublic(**result.as_dict(), stale=stale))


def random_run(rng: np.random.Generator, issued_at: datetime, levels: tuple[float, ...]) -> MinuteQuantiles:
    minutes = int(rng.integers(1, 90))
    first = int(issued_at.timestamp()) // 60 * 60 + 60 * int(rng.integers(-3, 3))
    scale = float(rng.choice([1e-7, 1e-3, 0.4, 1.0, 120.0, 3e5, 2e17]))
    # values as the store gives them back: float32 widened to float64 (long reprs), zeros included
    values = (rng.gamma(0.7, scale, size=(minutes, max(1, len(levels)))) * rng.integers(0, 2, size=(minutes, 1)))
    values = np.sort(values.astype("float32").astype("float64"), axis=1)
    point = values[:, len(levels) // 2].copy()
    version = [None, "v-2026-11-29T00:00", 'é"x'][int(rng.integers(0, 3))]
    return MinuteQuantiles(issued_at=issued_at, model_version_id=version,
                           minutes_s=first + 60 * np.arange(minutes, dtype=np.int64), levels=levels,
                           values=values if levels else np.empty((minutes, 0)), point=point)


def test_prepared_bodies_are_the_schemas_bytes_for_any_clock_forecast_and_id():
    rng = np.random.default_rng(16)
    ids = ["llama", "model-000042", 'quo"te\\back', "ünïcødé-模型", "tab\tnewline", "x" * 256]
    level_sets = [(0.1, 0.5, 0.9, 0.95, 0.99), (0.5, 0.9), (0.1, 0.5, 0.95), (0.99,), ()]
    compared = 0
    for case in range(400):
        issued_at = NOW - timedelta(seconds=float(rng.uniform(0, 4000)), microseconds=int(rng.integers(0, 10**6)))
        levels = level_sets[case % len(level_sets)]
        run = None if case % 17 == 0 else random_run(rng, issued_at, levels)
        model_id = ids[case % len(ids)]
        lead_time_s = float(rng.choice([45.0, 19.76, 0.001, 290.0 * 1.2 + 5.0, 3600.0, float(rng.uniform(1, 900))]))
        replica_rps = [None, 0.001, 2.0, float(rng.uniform(0.5, 20.0))][case % 4]
        quantile = float(rng.choice([0.9, 0.5, 0.93, 0.1, 0.999]))
        max_age_s = [None, 180.0, 1800.0][case % 3]  # PREWARM_FORECAST_FRESH_S: none, the default, a longer one
        prepared = prepare_recommendation(model_id, run, lead_time_s=lead_time_s, replica_rps=replica_rps,
                                          quantile=quantile, max_age_s=max_age_s)
        assert prepared is not None
        for _ in range(8):  # clocks before, inside and past the run's minutes, and sub-second ones
            now = issued_at + timedelta(seconds=float(rng.uniform(-300, 5500)))
            stale = bool(rng.integers(0, 2))
            expected = schema_bytes(run, model_id=model_id, now=now, lead_time_s=lead_time_s,
                                    replica_rps=replica_rps, quantile=quantile, stale=stale, max_age_s=max_age_s)
            assert prepared.body(now.timestamp(), stale) == expected, (case, model_id, now)
            compared += 1
    assert compared == 3200


def test_every_reason_is_covered_and_gaps_take_the_full_path():
    rng = np.random.default_rng(3)
    run = random_run(rng, NOW - timedelta(seconds=30), (0.1, 0.5, 0.9))
    reasons = set()
    for max_age_s in (None, 180.0):  # no freshness limit: the run expires; the default: it goes stale first
        prepared = prepare_recommendation("m", run, lead_time_s=45.0, replica_rps=2.0, quantile=0.9,
                                          max_age_s=max_age_s)
        for offset_s in range(-600, 6000, 37):
            now = NOW + timedelta(seconds=offset_s)
            body = prepared.body(now.timestamp(), False)
            assert body == schema_bytes(run, model_id="m", now=now, lead_time_s=45.0, replica_rps=2.0, quantile=0.9,
                                        stale=False, max_age_s=max_age_s)
            reasons.add(SCHEMA.validate_json(body).reason)
    assert reasons == {"forecast", "forecast_expired", "forecast_stale"}
    gappy = MinuteQuantiles(issued_at=run.issued_at, model_version_id=None, minutes_s=run.minutes_s[[0, 2, 3]],
                            levels=run.levels, values=run.values[[0, 2, 3]], point=run.point[[0, 2, 3]])
    assert prepare_recommendation("m", gappy, lead_time_s=45.0, replica_rps=2.0, quantile=0.9) is None


# --- the hot path in the app --------------------------------------------------------------------------------------


def auth(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def store_forecast(engine, model_id: str, q90: float, issued_at: datetime = NOW - timedelta(seconds=30)) -> None:
    minutes = pd.date_range(pd.Timestamp(issued_at).floor("min"), periods=60, freq="min")
    frame = pd.DataFrame({"unique_id": model_id, "ds": minutes, "point": 100.0, "q0.5": 100.0, "q0.9": q90,
                          "q0.99": q90 * 2})
    write_forecasts(engine, frame, issued_at=issued_at, model_version_id=None)


def _note_hot_path(app) -> list[bool]:
    """Records, per request, whether the app's hot path answered it (True) or left it to the route (False)."""
    answered: list[bool] = []
    answer = app.hot_path.answer

    async def noting(scope, send):
        done = await answer(scope, send)
        answered.append(done)
        return done

    app.hot_path.answer = noting
    return answered


@pytest.fixture
def served_app(engine, settings):
    """An app with a background refresher (so the hot path is on), a model with a forecast, and a read token."""
    read = create_token(engine, name="keda", scopes=["read"])
    admin = create_token(engine, name="admin", scopes=["admin"])
    setup = create_app(settings, engine, clock=lambda: NOW)
    with TestClient(setup) as client:
        assert client.put("/v1/models/llama", json={"replica_rps": 2.0}, headers=auth(admin)).status_code == 200
    store_forecast(engine, "llama", 150.0)
    app = create_app(settings.model_copy(update={"api_snapshot_refresh_s": 3600.0, "token_cache_s": 1.0}), engine,
                     clock=lambda: NOW)
    answered = _note_hot_path(app)
    with TestClient(app) as client:
        assert app.state.revocations.listening.wait(10)
        yield client, app, answered, read


def test_the_hot_path_answers_byte_for_byte_as_the_route(served_app):
    client, _, answered, read = served_app
    first = client.get("/v1/models/llama/recommendation", headers=auth(read))  # token not cached yet: the route
    second = client.get("/v1/models/llama/recommendation", headers=auth(read))  # cached: the hot path
    assert answered == [False, True]
    assert first.status_code == second.status_code == 200 and first.content == second.content
    assert first.headers["content-type"] == second.headers["content-type"] == "application/json"
    assert first.headers["content-length"] == second.headers["content-length"]
    assert first.json()["reason"] == "forecast" and first.json()["quantile"] == 0.9
    # what the hot path leaves to the route: a quantile, an unknown model, a body, no or a wrong token
    assert client.get("/v1/models/llama/recommendation?quantile=0.9", headers=auth(read)).content == first.content
    assert client.get("/v1/models/nope/recommendation", headers=auth(read)).status_code == 404
    assert client.request("GET", "/v1/models/llama/recommendation", headers=auth(read),
                          content=b"x").content == first.content
    assert client.get("/v1/models/llama/recommendation").status_code == 401
    assert client.get("/v1/models/llama/recommendation", headers=auth("pw_nope")).status_code == 401
    assert answered == [False, True, False, False, False, False, False]
    metrics = client.get("/metrics").text
    assert ('prewarm_api_request_seconds_count{method="GET",route="/v1/models/{model_id}/recommendation",'
            'status="200"} 4.0') in metrics


def test_a_stale_forecast_answers_no_replicas_on_the_hot_path_and_the_route(engine, settings):
    """A run older than PREWARM_FORECAST_FRESH_S (the forecast job stopped) is not served as current for the rest of
    its hour: 200 with the replica fields null and reason forecast_stale, its age given, from both paths alike
    (KEDA's metrics-api scaler reads the null as a failure and applies fallback)."""
    read = create_token(engine, name="keda", scopes=["read"])
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id="llama", replica_rps=2.0)])
    store_forecast(engine, "llama", 150.0, issued_at=NOW)
    clock = {"now": NOW + timedelta(minutes=1)}
    app = create_app(settings.model_copy(update={"api_snapshot_refresh_s": 3600.0}), engine,
                     clock=lambda: clock["now"])
    answered = _note_hot_path(app)
    with TestClient(app) as client:
        fresh = client.get("/v1/models/llama/recommendation", headers=auth(read)).json()
        assert fresh["reason"] == "forecast" and fresh["replicas_at_lead_time"] == 2  # 150/min at 120 a replica
        clock["now"] = NOW + timedelta(minutes=10)  # inside the run's hour, older than the 180 s default
        route = client.get("/v1/models/llama/recommendation?quantile=0.9", headers=auth(read))
        hot = client.get("/v1/models/llama/recommendation", headers=auth(read))
    assert answered == [False, False, True]  # the first request caches the token; the last is the hot path's
    assert route.status_code == hot.status_code == 200 and route.content == hot.content
    body = hot.json()
    assert body["reason"] == "forecast_stale" and body["forecast_age_s"] == 600.0
    assert body["replicas_now"] is None and body["replicas_at_lead_time"] is None
    assert body["demand_at_lead_time_per_min"] is None and body["stale"] is False  # the database is fine


def test_a_token_revoked_here_is_refused_on_the_next_request_though_cached(served_app, engine):
    client, _, answered, read = served_app
    for _ in range(2):
        assert client.get("/v1/models/llama/recommendation", headers=auth(read)).status_code == 200
    assert answered == [False, True]
    assert revoke_token(engine, name="keda")
    assert client.get("/v1/models/llama/recommendation", headers=auth(read)).status_code == 401
    assert answered[-1] is False


def test_a_revocation_announced_by_the_database_reaches_a_cached_token_at_once(served_app, engine):
    client, _, answered, read = served_app
    for _ in range(2):
        assert client.get("/v1/models/llama/recommendation", headers=auth(read)).status_code == 200
    assert answered == [False, True]  # verified a moment ago: trusted for a whole second by the cache alone
    assert revoke_in_database(engine, name="keda")  # what `prewarm token revoke` in another process does
    revoked_at = time.monotonic()
    while client.get("/v1/models/llama/recommendation", headers=auth(read)).status_code == 200:
        assert time.monotonic() - revoked_at < 0.3, "the notification did not reach the cache"
        time.sleep(0.005)
    print(f"\nrevoked token refused {1000 * (time.monotonic() - revoked_at):.1f} ms after the revocation committed")


# --- PREWARM_API_WORKERS --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "count"), [("1", 1), ("4", 4), (" 3 ", 3), ("64", 64), ("auto", None),
                                              ("AUTO", None)])
def test_api_workers_accepts_counts_and_auto(monkeypatch, value, count):
    monkeypatch.setenv("PREWARM_API_WORKERS", value)
    settings = load_settings()
    cores = len(os.sched_getaffinity(0))
    assert settings.api_worker_count == (count if count is not None else max(1, min(cores, 8)))


@pytest.mark.parametrize("value", ["0", "65", "-1", "2.5", "two", "", "true"])
def test_api_workers_refuses_anything_else_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("PREWARM_API_WORKERS", value)
    with pytest.raises(SettingsError) as error:
        load_settings()
    assert "PREWARM_API_WORKERS" in str(error.value) and "from 1 to 64 or 'auto'" in str(error.value)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_with_two_workers_each_loads_and_refreshes_its_own_snapshot(engine, db_url, tmp_path):
    admin = create_token(engine, name="admin", scopes=["admin"])
    read = create_token(engine, name="keda", scopes=["read"])
    now = datetime.now(timezone.utc)
    port = _free_port()
    env = {**os.environ, "DATABASE_URL": db_url, "PREWARM_DATA_DIR": str(tmp_path), "PYTHONPATH": str(REPO),
           "PREWARM_API_WORKERS": "2", "PREWARM_API_SNAPSHOT_REFRESH_S": "0.3"}
    server = subprocess.Popen([sys.executable, "-m", "forecaster.cli", "serve", "--port", str(port),
                               "--no-scheduler"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def answers(count: int) -> list[dict]:
        out = []
        for _ in range(count):  # a new connection each: the kernel hands them to either worker
            with httpx.Client(base_url=base, timeout=10) as fresh:
                response = fresh.get("/v1/models/llama/recommendation", headers=auth(read))
                assert response.status_code == 200, response.text
                out.append(response.json())
        return out

    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.put(f"{base}/v1/models/llama", json={"replica_rps": 1.0}, headers=auth(admin),
                             timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, "prewarm serve did not come up"
            time.sleep(0.3)
        workers = [p for p in psutil.Process(server.pid).children(recursive=True) if "python" in p.name().lower()]
        assert len(workers) >= 2
        store_forecast(engine, "llama", 150.0, issued_at=now - timedelta(seconds=5))
        deadline = time.monotonic() + 30
        while {a["reason"] for a in answers(12)} != {"forecast"}:  # every worker found the run by itself
            assert time.monotonic() < deadline, "a worker did not load the forecast run"
            time.sleep(0.3)
        assert {a["replicas_at_lead_time"] for a in answers(12)} == {3}  # 150/min at 60 per replica-minute
        store_forecast(engine, "llama", 600.0, issued_at=now)  # a newer run lands
        deadline = time.monotonic() + 30
        while {a["replicas_at_lead_time"] for a in answers(12)} != {10}:
            assert time.monotonic() < deadline, "a worker kept the older run"
            time.sleep(0.3)
    finally:
        stop_process(server, timeout=20)


def _listening_sockets(port: int) -> int:
    """Listening TCP sockets on ``port`` in this machine's network namespace (from /proc/net/tcp and tcp6)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as handle:
            for line in list(handle)[1:]:
                local, state = line.split()[1], line.split()[3]
                count += int(local.rsplit(":", 1)[1], 16) == port and state == "0A"
    return count


def _workers_of(server: subprocess.Popen) -> list[psutil.Process]:
    """The live API worker processes (multiprocessing's resource tracker is a child too)."""
    workers = []
    for child in psutil.Process(server.pid).children():
        try:
            if "python" in child.name().lower() and "resource_tracker" not in " ".join(child.cmdline()):
                workers.append(child)
        except psutil.Error:  # a worker that just died (a zombie until the supervisor reaps it)
            pass
    return workers


def test_serve_workers_each_accept_on_their_own_socket_and_one_that_dies_is_replaced(engine, db_url, tmp_path):
    """Each worker listens on its own SO_REUSEPORT socket, so kept-alive connections spread over the workers
    (uvicorn's shared socket left them all on one: api/workers.py); a killed worker is replaced; a second server
    on the same port is refused with a clear error instead of silently sharing the connections."""
    read = create_token(engine, name="keda", scopes=["read"])
    port = _free_port()
    env = {**os.environ, "DATABASE_URL": db_url, "PREWARM_DATA_DIR": str(tmp_path), "PYTHONPATH": str(REPO),
           "PREWARM_API_WORKERS": "2"}
    argv = [sys.executable, "-m", "forecaster.cli", "serve", "--port", str(port), "--no-scheduler"]
    server = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    clients: list[httpx.Client] = []
    try:
        deadline = time.monotonic() + 90
        while _listening_sockets(port) < 2 or len(_workers_of(server)) < 2:
            assert server.poll() is None and time.monotonic() < deadline, "prewarm serve did not come up"
            time.sleep(0.3)
        assert _listening_sockets(port) == 2  # one per worker, not one shared
        for _ in range(32):  # kept-alive connections, as an autoscaler holds them
            client = httpx.Client(base_url=base, timeout=10)
            assert client.get("/healthz").status_code == 200
            clients.append(client)
        held = {w.pid: sum(c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port
                           for c in w.net_connections(kind="tcp")) for w in _workers_of(server)}
        assert sum(held.values()) == 32 and min(held.values()) > 0, held  # all on one: 2 ** -31 by chance

        second = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
        assert second.returncode == 3 and "already accepts connections" in second.stderr, second.stderr

        victim = _workers_of(server)[0]
        victim.kill()
        deadline = time.monotonic() + 60
        while victim.pid in [w.pid for w in _workers_of(server)] or len(_workers_of(server)) < 2 \
                or _listening_sockets(port) < 2:
            assert server.poll() is None and time.monotonic() < deadline, "the dead worker was not replaced"
            time.sleep(0.3)
        for _ in range(8):
            with httpx.Client(base_url=base, timeout=10) as fresh:
                assert fresh.get("/v1/models/nope/recommendation", headers=auth(read)).status_code == 404
    finally:
        for client in clients:
            client.close()
        stop_process(server, timeout=40)
    assert server.returncode == 0
    assert not [p for p in psutil.process_iter(["cmdline"]) if "api.workers" in " ".join(p.info["cmdline"] or [])
                and p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
