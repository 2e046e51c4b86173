"""Model ids with '/', '%', '?', '#', spaces or non-ASCII letters on every per-model route, over real HTTP.

Hugging Face ids are ``org/name``; registration accepts them, so every route under ``/v1/models/{id}`` must
answer for them (the id percent-encoded in the path) exactly as it answers for the same model under a plain
id. The hot path (``api.hotpath``) must take them too, and give way where the route would.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from urllib.parse import quote

import httpx
import pandas as pd
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text

from api.main import create_app
from forecaster.ingest.service import push_cold_starts, push_counts
from forecaster.store.catalog import ServingModelSpec, upsert_models
from forecaster.store.forecasts import write_forecasts
from forecaster.store.tokens import create_token
from tests.uvicorn_fixtures import serving

NOW = datetime(2026, 11, 29, 12, 0, 30, tzinfo=timezone.utc)
T0 = datetime(2026, 11, 29, 11, 50, tzinfo=timezone.utc)
PLAIN = "plain-model"
ODD_IDS = ["meta-llama/Llama-3-8B", "a/b/c", "org/forecast", "org/series", "50%off", "what?#x", "with space",
           "ΟΔΟΣ/μοντέλο-7b", "İzmir/chat"]
#: Every per-model GET route; {} is the id, percent-encoded.
READS = ["/v1/models/{}", "/v1/models/{}/forecast", "/v1/models/{}/recommendation", "/v1/models/{}/cold-start",
         "/v1/models/{}/series", "/v1/models/{}/coldstarts", "/v1/models/{}/actions"]


def encoded(model_id: str) -> str:
    return quote(model_id, safe="")


def same_model(body, model_id: str):
    """``body`` with ``model_id`` written as PLAIN, and what differs between two models' rows left out
    (action ids, row times)."""
    if isinstance(body, dict):
        return {k: same_model(v, model_id) for k, v in body.items()
                if k not in ("created_at", "updated_at") and not (k == "id" and isinstance(v, int))}
    if isinstance(body, list):
        return [same_model(v, model_id) for v in body]
    return PLAIN if body == model_id else body


def seed(engine, settings, model_id: str) -> None:
    """The same model under ``model_id``: registered (as the CLI and auto-registration do), counts, a fresh run,
    a cold start, an action."""
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id=model_id, replica_rps=2.0, labels={"team": "x"})])
    push_counts(engine, settings, [{"model_id": model_id, "minute": (T0 + timedelta(minutes=i)).isoformat(),
                                    "count": 10 + i} for i in range(10)], now=NOW)
    for issued_at in (T0 + timedelta(seconds=20), NOW - timedelta(seconds=30)):
        minutes = pd.date_range(pd.Timestamp(issued_at).floor("min"), periods=30, freq="min")
        write_forecasts(engine, pd.DataFrame({"unique_id": model_id, "ds": minutes, "point": 12.0, "q0.1": 6.0,
                                              "q0.5": 12.0, "q0.9": 30.0}),
                        issued_at=issued_at, model_version_id=None)
    push_cold_starts(engine, settings, [{"model_id": model_id, "node_id": "n1", "started_at": "2026-11-29T11:52:00Z",
                                         "total_seconds": 40.0}], now=NOW)
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO actions (kind, model_id, node_id, target, not_before, deadline, reason, expected_benefit, "
            "status, updated_at) VALUES ('prepull', :m, 'n1', 'img:1', :nb, :dl, 'forecast_spike', 40, 'succeeded', "
            ":nb)"), {"m": model_id, "nb": T0 + timedelta(minutes=3), "dl": T0 + timedelta(minutes=8)})


@pytest.fixture
def app_and_tokens(engine, settings):
    read = create_token(engine, name="read", scopes=["read"])
    admin = create_token(engine, name="admin", scopes=["admin"])
    for model_id in (PLAIN, *ODD_IDS):
        seed(engine, settings, model_id)
    return read, admin


def test_every_per_model_route_answers_for_odd_ids_as_for_a_plain_one(engine, settings, app_and_tokens):
    read, admin = app_and_tokens
    with TestClient(create_app(settings, engine, clock=lambda: NOW)) as client:
        client.headers["Authorization"] = f"Bearer {read}"
        expected = {}
        for route in READS:
            response = client.get(route.format(PLAIN))
            assert response.status_code == 200, (route, response.text)
            expected[route] = same_model(response.json(), PLAIN)
        assert expected["/v1/models/{}/series"]["error"]["scored_minutes"] > 0  # not a comparison of empties
        assert expected["/v1/models/{}/recommendation"]["reason"] == "forecast"
        assert len(expected["/v1/models/{}/actions"]["data"]) == 1
        for model_id in ODD_IDS:
            for route in READS:
                response = client.get(route.format(encoded(model_id)))
                assert response.status_code == 200, (model_id, route, response.text)
                assert same_model(response.json(), model_id) == expected[route], (model_id, route)
        # registering again through the API: PUT takes the id as GET does
        for model_id in ODD_IDS:
            put = client.put(f"/v1/models/{encoded(model_id)}", json={"replica_rps": 3.0},
                             headers={"Authorization": f"Bearer {admin}"})
            assert put.status_code == 200 and put.json()["id"] == model_id, (model_id, put.text)
            assert client.get(f"/v1/models/{encoded(model_id)}").json()["replica_rps"] == 3.0
        created = client.put(f"/v1/models/{encoded('new-org/new model')}", json={},
                             headers={"Authorization": f"Bearer {admin}"})
        assert created.status_code == 200 and created.json()["id"] == "new-org/new model"
        # the routes' own query parameters still reach them
        plain = client.get(f"/v1/models/{PLAIN}/forecast", params={"horizon": 5, "quantiles": "0.9"}).json()
        odd = client.get(f"/v1/models/{encoded('a/b/c')}/forecast", params={"horizon": 5, "quantiles": "0.9"})
        assert same_model(odd.json(), "a/b/c") == same_model(plain, PLAIN) and len(plain["points"]) == 5
        # an id sent with its slashes as they are (a KEDA metrics-api URL written by hand) reaches the model too
        literal = client.get("/v1/models/meta-llama/Llama-3-8B/recommendation")
        assert literal.status_code == 200 and literal.json()["model_id"] == "meta-llama/Llama-3-8B"
        # an encoded id that ends like a route is the model itself, not that route of a shorter id
        assert client.get(f"/v1/models/{encoded('org/forecast')}").json()["id"] == "org/forecast"
        assert client.get(f"/v1/models/{encoded('org/series')}").json()["id"] == "org/series"
        # unknown ids with '/' are a 404 naming the whole id; an empty id is no model
        missing = client.get(f"/v1/models/{encoded('meta-llama/nope')}/series")
        assert missing.status_code == 404 and "meta-llama/nope" in missing.json()["detail"]
        assert client.get("/v1/models//forecast").status_code == 404
        # the catalogue lists them under their own ids
        listed = client.get("/v1/models", params={"limit": 100}).json()
        assert set(ODD_IDS) <= {m["id"] for m in listed["data"]}


def test_the_hot_path_serves_odd_ids_as_the_route_does(engine, settings, app_and_tokens):
    read, _ = app_and_tokens
    app = create_app(settings.model_copy(update={"api_snapshot_refresh_s": 3600.0}), engine, clock=lambda: NOW)
    answered: list[bool] = []
    answer = app.hot_path.answer

    async def noting(scope, send):
        answered.append(await answer(scope, send))
        return answered[-1]

    app.hot_path.answer = noting
    headers = {"Authorization": f"Bearer {read}"}
    with TestClient(app) as client:
        plain = client.get(f"/v1/models/{PLAIN}/recommendation", headers=headers)  # fills the token cache
        assert plain.status_code == 200 and answered == [False]
        for model_id in ODD_IDS:
            answered.clear()
            hot = client.get(f"/v1/models/{encoded(model_id)}/recommendation", headers=headers)
            assert answered == [True], model_id
            assert hot.status_code == 200 and same_model(hot.json(), model_id) == same_model(plain.json(), PLAIN)
            assert hot.json()["model_id"] == model_id
        # a tail that came encoded is part of an id: the hot path leaves it to the catalogue route
        answered.clear()
        catalogue = client.get(f"/v1/models/{encoded('x/recommendation')}", headers=headers)
        assert answered == [False] and catalogue.status_code == 404


def test_odd_ids_over_a_real_socket(engine, settings, app_and_tokens):
    """uvicorn's own decoding of the path (raw_path kept), not the test client's."""
    read, _ = app_and_tokens
    app = create_app(settings, engine, clock=lambda: NOW)
    with serving(app) as base:
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {read}"}) as client:
            for model_id in ("meta-llama/Llama-3-8B", "what?#x", "ΟΔΟΣ/μοντέλο-7b", "org/forecast"):
                for route in ("/v1/models/{}", "/v1/models/{}/forecast", "/v1/models/{}/series"):
                    response = client.get(route.format(encoded(model_id)))
                    assert response.status_code == 200, (model_id, route, response.text)
                    assert model_id in (response.json().get("model_id"), response.json().get("id"))
