"""REST API against a real PostgreSQL: auth scopes, catalogue, forecasts, recommendations, push ingest, audit."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pandas as pd
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text

from api.main import create_app
from forecaster.coldstart.service import train_latency_model
from forecaster.store.forecasts import write_forecasts
from forecaster.store.tokens import create_token, revoke_token

NOW = datetime(2026, 11, 29, 12, 0, 30, tzinfo=timezone.utc)


@pytest.fixture
def tokens(engine):
    return {scope: create_token(engine, name=scope, scopes=[scope]) for scope in ("read", "ingest", "admin")}


@pytest.fixture
def client(engine, settings, tokens):
    app = create_app(settings, engine, clock=lambda: NOW)
    with TestClient(app) as client:
        yield client


def auth(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def put_model(client, tokens, model_id="llama", **spec):
    body = {"image_ref": "vllm/vllm-openai:v0.6", "replica_rps": 2.0, **spec}
    return client.put(f"/v1/models/{model_id}", json=body, headers=auth(tokens["admin"]))


def store_forecast(engine, model_id="llama", issued_at=NOW - timedelta(seconds=30), q90=150.0):
    start = pd.Timestamp(issued_at).floor("min")
    minutes = pd.date_range(start, periods=60, freq="min")
    frame = pd.DataFrame({"unique_id": model_id, "ds": minutes, "point": 100.0, "p_any": 1.0,
                          "q0.1": 50.0, "q0.5": 100.0, "q0.9": q90})
    frame.loc[5:, "q0.9"] = q90 * 3  # a spike from minute 5 on
    write_forecasts(engine, frame, issued_at=issued_at, model_version_id=None)


# --- auth -------------------------------------------------------------------------


@pytest.mark.parametrize(("method", "path", "scope"), [
    ("get", "/v1/models", "read"),
    ("get", "/v1/models/llama/forecast", "read"),
    ("get", "/v1/models/llama/recommendation", "read"),
    ("get", "/v1/plans", "read"),
    ("get", "/v1/actions", "read"),
    ("put", "/v1/models/llama", "admin"),
    ("post", "/v1/invocations", "ingest"),
    ("post", "/v1/coldstarts", "ingest"),
    ("post", "/v1/actuator/pause", "admin"),
    ("post", "/v1/actuator/resume", "admin"),
    ("get", "/v1/actuator", "read"),
])
def test_every_endpoint_needs_a_token_with_its_scope(client, tokens, method, path, scope):
    assert getattr(client, method)(path).status_code == 401
    assert getattr(client, method)(path, headers=auth("pw_not-a-token")).status_code == 401
    wrong = next(s for s in ("read", "ingest") if s != scope)
    response = getattr(client, method)(path, headers=auth(tokens[wrong]))
    assert response.status_code == 403 and scope in response.json()["detail"]


def test_revoked_token_is_refused(engine, settings):
    token = create_token(engine, name="ci", scopes=["read"])
    assert revoke_token(engine, name="ci")
    with TestClient(create_app(settings, engine, clock=lambda: NOW)) as client:
        assert client.get("/v1/models", headers=auth(token)).status_code == 401


def test_a_token_revoked_in_the_serving_process_fails_at_once_though_cached(engine, settings):
    token = create_token(engine, name="ci", scopes=["read"])
    with TestClient(create_app(settings, engine, clock=lambda: NOW)) as client:
        assert client.get("/v1/models", headers=auth(token)).status_code == 200  # verified: now in the cache
        assert revoke_token(engine, name="ci")
        assert client.get("/v1/models", headers=auth(token)).status_code == 401  # the very next request


def test_tokens_are_stored_hashed(engine, tokens):
    with engine.connect() as conn:
        stored = conn.execute(text("SELECT token_sha256 FROM api_tokens")).scalars().all()
    assert len(stored) == 3 and not set(tokens.values()) & set(stored)


# --- catalogue --------------------------------------------------------------------


def test_put_get_list_models(client, tokens):
    created = put_model(client, tokens, gpus_per_replica=2, labels={"team": "search"})
    assert created.status_code == 200 and created.json()["gpus_per_replica"] == 2
    assert put_model(client, tokens, gpus_per_replica=4).json()["gpus_per_replica"] == 4  # update
    listed = client.get("/v1/models", headers=auth(tokens["read"])).json()
    assert listed["count"] == 1 and listed["data"][0]["id"] == "llama"
    assert client.get("/v1/models/nope", headers=auth(tokens["read"])).status_code == 404
    bad = client.put("/v1/models/x", json={"replica_rps": -1}, headers=auth(tokens["admin"]))
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["body", "replica_rps"]


@pytest.mark.parametrize(("labels", "named"), [
    ({"cold_cost": "-1"}, "label 'cold_cost' must be a number from 0 to 1e+09"),  # was dropped from every plan
    ({"cold_cost": "1e12"}, "label 'cold_cost' must be a number from 0 to 1e+09"),  # dropped
    ({"cold_cost": "inf"}, "label 'cold_cost' must be a number from 0 to 1e+09"),  # dropped
    ({"cold_cost": "nan"}, "label 'cold_cost' must be a number from 0 to 1e+09"),  # planned at the default
    ({"cold_cost": "abc"}, "label 'cold_cost' must be a number from 0 to 1e+09"),  # planned at the default
    ({"cold_cost": ""}, "label 'cold_cost' must be a number from 0 to 1e+09"),
    ({"request_s": "0"}, "label 'request_s' must be a number of seconds above 0"),
    ({"prometheus_query": "  "}, "label 'prometheus_query' must be a PromQL expression, not empty"),
    ({"prometheus_burst_query": 'max(x{model="{model_id}"})'}, "'{model_id}' is not replaced in it"),
    ({"k8s_kind": "Pod"}, "label 'k8s_kind' must be one of Deployment, InferenceService"),
    ({"k8s_name": "Llama_70B"}, "label 'k8s_name' must be a Kubernetes object name"),
    ({"k8s_namespace": "a.b"}, "label 'k8s_namespace' must be a Kubernetes namespace"),
    ({"catalog": "gpt-5"}, "label 'catalog' must name an entry of the simulator's catalogue"),
])
def test_put_refuses_a_label_the_product_cannot_use_naming_it(client, engine, tokens, labels, named):
    """Issue: the label ``cold_cost`` took any text; the plan job later dropped the model from every plan (-1, 1e12,
    inf) or planned it at the default cost (nan, abc) without a word to the caller."""
    answer = put_model(client, tokens, labels={"team": "search", **labels})
    assert answer.status_code == 422, answer.text
    assert answer.json()["detail"][0]["loc"] == ["body", "labels"]
    assert named in answer.json()["message"]
    value = next(iter(labels.values()))
    assert len(value.strip()) < 3 or value not in answer.text  # a 422 never echoes the input
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM serving_models")).scalar() == 0


def test_put_accepts_the_labels_the_product_reads_when_usable(client, engine, tokens, settings):
    from forecaster.jobs.planning import fleet_from_store

    labels = {"cold_cost": " 7.5 ", "request_s": "1.5", "prometheus_query": 'sum(x{model="llama"})',
              "k8s_kind": "InferenceService", "k8s_name": "llama-70b.v2", "k8s_namespace": "serving",
              "catalog": "llama-3-70b-instruct", "team": "anything at all"}
    answer = put_model(client, tokens, labels=labels)
    assert answer.status_code == 200 and answer.json()["labels"] == labels
    assert put_model(client, tokens, model_id="free", labels={"cold_cost": "0"}).status_code == 200
    fleet = fleet_from_store(engine, now=NOW, default_cold_cost=1.0)
    assert fleet.models.loc["llama", "cold_cost"] == 7.5 and fleet.models.loc["free", "cold_cost"] == 0.0


def test_put_answers_with_what_this_request_wrote(client, engine, tokens, db_url):
    """Issue: PUT read the row back in a second transaction, so under concurrent PUTs the 200 body showed another
    writer's spec (68 of 96 answers in the audit). Here another writer commits right after this PUT's write: the
    answer is still this PUT's spec."""
    from sqlalchemy import event

    from forecaster.store.db import make_engine

    other = make_engine(db_url)
    wrote, interfered = [], []

    def saw(conn, cursor, statement, parameters, context, executemany):
        if statement.lstrip().upper().startswith("INSERT INTO SERVING_MODELS"):
            wrote.append(True)

    def after_release(dbapi_connection, record):  # the PUT's transaction has committed and let go of its connection
        if wrote and not interfered:
            interfered.append(True)
            with other.begin() as conn:
                conn.execute(text("UPDATE serving_models SET image_ref = 'img:other', replica_rps = 99, "
                                  "labels = '{\"writer\": \"other\"}' WHERE id = 'llama'"))

    event.listen(engine, "before_cursor_execute", saw)
    event.listen(engine.pool, "checkin", after_release)
    try:
        answer = put_model(client, tokens, image_ref="img:mine", replica_rps=3.0, labels={"writer": "mine"})
    finally:
        event.remove(engine, "before_cursor_execute", saw)
        event.remove(engine.pool, "checkin", after_release)
        other.dispose()
    assert interfered, "the other writer never ran"
    assert answer.status_code == 200
    body = answer.json()
    assert (body["image_ref"], body["replica_rps"], body["labels"]) == ("img:mine", 3.0, {"writer": "mine"})
    stored = client.get("/v1/models/llama", headers=auth(tokens["read"])).json()
    assert (stored["image_ref"], stored["labels"]) == ("img:other", {"writer": "other"})  # the other came after


# --- forecasts and recommendations ------------------------------------------------


def test_forecast_with_horizon_and_quantiles(client, engine, tokens):
    put_model(client, tokens)
    assert client.get("/v1/models/llama/forecast", headers=auth(tokens["read"])).status_code == 404
    store_forecast(engine)
    body = client.get("/v1/models/llama/forecast?horizon=10&quantiles=0.5,0.9", headers=auth(tokens["read"])).json()
    assert body["horizon_min"] == 10 and len(body["points"]) == 10 and body["age_s"] == 30.0
    assert body["points"][0]["quantiles"] == {"0.5": 100.0, "0.9": 150.0}
    assert body["points"][5]["quantiles"]["0.9"] == 450.0 and body["stale"] is False
    assert client.get("/v1/models/llama/forecast?quantiles=0.99", headers=auth(tokens["read"])).status_code == 422
    assert client.get("/v1/models/llama/forecast?quantiles=abc", headers=auth(tokens["read"])).status_code == 422


def test_recommendation_covers_demand_at_the_cold_start_lead_time(client, engine, settings, tokens, now):
    put_model(client, tokens)  # 2 rps per replica = 120 per minute
    store_forecast(engine)
    body = client.get("/v1/models/llama/recommendation", headers=auth(tokens["read"])).json()
    # no latency model trained yet and no sizes registered: not the 0-byte physics prior (runtime start-up +
    # registration, 12.3 s) but PREWARM_DEFAULT_COLD_START_S (45 s), with the planner's margins 45 * 1.2 + 5 =
    # 59 s: ready at 12:00, q0.9 there is 150/min -> 2 replicas; now 150/min -> 2
    assert (body["replicas_now"], body["replicas_at_lead_time"]) == (2, 2)
    assert body["lead_time_s"] == pytest.approx(settings.default_cold_start_s * 1.2 + 5.0)
    # observed cold starts of ~5 minutes, once the latency model is trained on them, move the lead time into the
    # spike (450/min -> 4 replicas)
    events = [{"model_id": "llama", "node_id": f"n{i % 3}", "started_at": f"2026-11-29T10:{i:02d}:00Z",
               "total_seconds": 290.0, "cache_state": "none"} for i in range(40)]
    assert client.post("/v1/coldstarts", json={"events": events}, headers=auth(tokens["ingest"])).status_code == 200
    train_latency_model(engine, settings, NOW)
    body = client.get("/v1/models/llama/recommendation", headers=auth(tokens["read"])).json()
    assert body["lead_time_s"] == pytest.approx(290.0 * 1.2 + 5.0, rel=0.05)
    assert (body["replicas_at_lead_time"], body["reason"]) == (4, "forecast")
    # requests that come in 10-second bursts at twice the minute's mean rate: a replica serves half as many
    put_model(client, tokens, burst_factor=2.0)
    body = client.get("/v1/models/llama/recommendation", headers=auth(tokens["read"])).json()
    assert (body["replicas_now"], body["replicas_at_lead_time"]) == (3, 8)
    put_model(client, tokens, model_id="quiet")
    assert client.get("/v1/models/quiet/recommendation",
                      headers=auth(tokens["read"])).json()["reason"] == "no_forecast"


# --- push ingest ------------------------------------------------------------------


def test_push_invocations_idempotent_and_422_names_row_and_field(client, tokens, engine):
    put_model(client, tokens)
    rows = [{"model_id": "llama", "minute": "2026-11-29T11:00:00Z", "count": 3},
            {"model_id": "llama", "minute": "2026-11-29T11:01:00Z", "count": 4}]
    first = client.post("/v1/invocations", json={"rows": rows}, headers=auth(tokens["ingest"]))
    second = client.post("/v1/invocations", json={"rows": rows}, headers=auth(tokens["ingest"]))
    assert first.status_code == 200 and first.json()["invocations"] == 7 and not first.json()["duplicate"]
    assert second.json()["duplicate"] is True
    bad = rows + [{"model_id": "llama", "minute": "2026-11-29T11:02:00Z", "count": -1}]
    rejected = client.post("/v1/invocations", json={"rows": bad}, headers=auth(tokens["ingest"]))
    assert rejected.status_code == 422
    assert {k: rejected.json()[k] for k in ("reason", "row", "field")} == {
        "reason": "negative_count", "row": 3, "field": "count"}
    with engine.connect() as conn:
        assert conn.execute(text("SELECT sum(count) FROM invocations")).scalar() == 7


# --- audit and health -------------------------------------------------------------


def test_plans_and_actions_listing(client, engine, tokens):
    with engine.begin() as conn:
        plan_id = conn.execute(text("INSERT INTO plans (planned_at, summary) VALUES (:t, '{\"actions\": 1}') "
                                    "RETURNING id"), {"t": NOW}).scalar()
        conn.execute(text("INSERT INTO actions (plan_id, kind, model_id, node_id, target, reason, status) "
                          "VALUES (:p, 'prepull', 'llama', 'n1', 'img', 'forecast_spike', 'succeeded')"),
                     {"p": plan_id})
    from forecaster.store.actions import reconcile_action_state

    reconcile_action_state(engine)  # written past the ledger: counted as the scheduler's start counts it
    plans = client.get("/v1/plans", headers=auth(tokens["read"])).json()
    assert plans["count"] == 1 and plans["data"][0]["actions"] == 1
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO plans (planned_at, summary) VALUES (:t, '{}')"), {"t": NOW + timedelta(hours=1)})
    later = client.get("/v1/plans", params={"since": (NOW + timedelta(minutes=1)).isoformat(), "limit": 1},
                       headers=auth(tokens["read"])).json()
    assert later["count"] == 1 and later["data"][0]["actions"] == 0  # the count follows the filter, as actions'
    assert client.get("/v1/plans?limit=1", headers=auth(tokens["read"])).json()["count"] == 2
    actions = client.get("/v1/actions?status=succeeded", headers=auth(tokens["read"])).json()
    assert actions["count"] == 1 and actions["data"][0]["kind"] == "prepull"
    assert client.get("/v1/actions?status=failed", headers=auth(tokens["read"])).json()["count"] == 0


def test_the_actions_count_follows_the_ledger_with_and_without_a_filter(client, engine, tokens):
    """Unfiltered or by status the count comes from the kept counts, by model or plan from the rows: the same."""
    from forecaster.actuation.ledger import StoreLedger
    from forecaster.contracts.actions import Action, ActionKind, ActionStatus, Reason

    with engine.begin() as conn:
        conn.execute(text("INSERT INTO serving_models (id) VALUES ('a'), ('b')"))
    ledger = StoreLedger(engine)
    with ledger.session() as s:
        ids = [s.submit_action(None, Action(kind=ActionKind.SCALE, model_id=m, reason=Reason.FORECAST_SPIKE,
                                            not_before=NOW, deadline=NOW + timedelta(minutes=5), replicas=r),
                               backend="dry-run", now=NOW)[0] for m, r in (("a", 1), ("a", 2), ("b", 1))]
        s.mark(ids[0], ActionStatus.FAILED, now=NOW + timedelta(minutes=1), reason="internal")
    read = auth(tokens["read"])
    counts = {query: client.get(f"/v1/actions{query}", headers=read).json()["count"]
              for query in ("", "?status=failed", "?status=pending", "?model_id=a", "?model_id=a&status=pending")}
    assert counts == {"": 3, "?status=failed": 1, "?status=pending": 2, "?model_id=a": 2,
                      "?model_id=a&status=pending": 1}
    newest = client.get("/v1/actions?limit=1", headers=read).json()["data"]
    assert [row["id"] for row in newest] == [ids[0]]  # the newest updated first: the one just marked


def test_health_readiness_and_metrics(client, engine, tokens):
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").status_code == 200  # no models yet: nothing to be fresh about
    put_model(client, tokens)
    assert client.get("/readyz").status_code == 503  # a model without forecasts
    store_forecast(engine)
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["checks"]["forecast_age_s"] == 30.0
    client.get("/v1/models", headers=auth(tokens["read"]))
    text_metrics = client.get("/metrics").text
    assert "prewarm_forecast_age_seconds 30.0" in text_metrics
    client.get("/v1/models/llama/recommendation", headers=auth(tokens["read"]))  # loads the snapshot
    text_metrics = client.get("/metrics").text
    assert 'prewarm_recommended_replicas{at="lead_time",model_id="llama"} 2.0' in text_metrics
    assert 'prewarm_api_request_seconds_count{method="GET",route="/v1/models",status="200"} 1.0' in text_metrics


def test_metrics_count_the_actions_the_ledger_recorded(client, engine):
    from forecaster.actuation.ledger import StoreLedger
    from forecaster.contracts.actions import Action, ActionKind, ActionStatus, Reason

    with engine.begin() as conn:
        conn.execute(text("INSERT INTO serving_models (id) VALUES ('m')"))
    ledger = StoreLedger(engine)
    with ledger.session() as s:
        ids = [s.submit_action(None, Action(kind=ActionKind.SCALE, model_id="m", reason=Reason.FORECAST_SPIKE,
                                            not_before=NOW, deadline=NOW + timedelta(minutes=5), replicas=r),
                               backend="dry-run", now=NOW)[0] for r in (1, 2, 3)]
        s.mark(ids[0], ActionStatus.RUNNING, now=NOW, start=True)
        s.mark(ids[0], ActionStatus.SUCCEEDED, now=NOW)
        s.mark(ids[1], ActionStatus.RUNNING, now=NOW, start=True)
    text_metrics = client.get("/metrics").text
    assert "# TYPE prewarm_actions_total counter" in text_metrics and "# TYPE prewarm_actions_open gauge" in text_metrics
    assert 'prewarm_actions_total{kind="scale",status="succeeded"} 1.0' in text_metrics
    assert 'prewarm_actions_open{kind="scale",status="running"} 1.0' in text_metrics
    assert 'prewarm_actions_open{kind="scale",status="pending"} 1.0' in text_metrics
    counter = text_metrics.split("prewarm_actions_total", 1)[1].split("# HELP", 1)[0]
    assert 'status="failed"' not in counter and 'status="pending"' not in counter  # only what finished counts
    with ledger.session() as s:  # the running one finishes: it leaves the gauge and the counter grows
        s.mark(ids[1], ActionStatus.FAILED, now=NOW)
    text_metrics = client.get("/metrics").text
    assert 'prewarm_actions_total{kind="scale",status="failed"} 1.0' in text_metrics
    assert 'status="running"' not in text_metrics.split("prewarm_actions_open{", 1)[1].split("# HELP", 1)[0]


def test_the_per_model_gauge_can_be_left_out(engine, settings, tokens):
    quiet = settings.model_copy(update={"recommendation_metrics": False})
    with TestClient(create_app(quiet, engine, clock=lambda: NOW)) as client:
        put_model(client, tokens)
        store_forecast(engine)
        recommendation = client.get("/v1/models/llama/recommendation", headers=auth(tokens["read"]))
        assert recommendation.json()["replicas_at_lead_time"] == 2  # the REST answer stays
        text_metrics = client.get("/metrics").text
    assert "prewarm_recommended_replicas" not in text_metrics
    assert "prewarm_forecast_age_seconds 30.0" in text_metrics  # the rest of /metrics stays


def test_openapi_is_served_and_versioned(client):
    spec = client.get("/openapi.json").json()
    assert {"/v1/models", "/v1/models/{model_id}/recommendation", "/v1/invocations"} <= set(spec["paths"])


def test_kill_switch_pause_and_resume(client, engine, tokens):
    from forecaster.store.actions import is_paused

    assert client.get("/v1/actuator", headers=auth(tokens["read"])).json()["paused"] is False
    paused = client.post("/v1/actuator/pause", json={"reason": "incident 42"}, headers=auth(tokens["admin"])).json()
    assert (paused["paused"], paused["reason"], paused["updated_by"]) == (True, "incident 42", "admin")
    assert is_paused(engine)
    assert client.post("/v1/actuator/resume", headers=auth(tokens["admin"])).json()["paused"] is False
    assert not is_paused(engine)


def test_pushed_peaks_move_the_burst_factor_once_per_minute(client, tokens, engine):
    """``peak_10s`` on pushed rows: each minute moves the factor once; the same counts sent again with peaks move
    it (a duplicate batch still carries its peaks), a correction of counted minutes does not, later minutes do."""
    from forecaster.contracts.bursts import BURST_ALPHA

    put_model(client, tokens)
    start = datetime(2026, 11, 29, 11, 0, tzinfo=timezone.utc)

    def push(minutes, count, peak=None):
        rows = [{"model_id": "llama", "minute": (start + timedelta(minutes=m)).isoformat(), "count": count,
                 **({"peak_10s": peak} if peak is not None else {})} for m in minutes]
        response = client.post("/v1/invocations", json={"rows": rows}, headers=auth(tokens["ingest"]))
        assert response.status_code == 200, response.text
        return response.json()

    def factor():
        with engine.connect() as conn:
            return conn.execute(text("SELECT burst_factor FROM serving_models WHERE id = 'llama'")).scalar()

    def after(k, ratio, prior=1.0):
        keep = (1.0 - BURST_ALPHA) ** k
        return keep * prior + (1.0 - keep) * ratio

    assert push(range(5), 120)["burst_factors_stored"] == 0 and factor() is None
    again = push(range(5), 120, peak=60)  # the same counts: a duplicate batch, whose peaks still count
    assert again["duplicate"] and again["burst_factors_stored"] == 1
    assert factor() == pytest.approx(after(5, 3.0))
    assert push(range(5), 120, peak=60)["burst_factors_stored"] == 0  # sent a third time: nothing moves
    assert push(range(3, 5), 90, peak=90)["burst_factors_stored"] == 0  # a correction of counted minutes
    assert factor() == pytest.approx(after(5, 3.0))
    assert push(range(5, 7), 120, peak=20)["burst_factors_stored"] == 1  # ratio 1
    assert factor() == pytest.approx(after(2, 1.0, prior=after(5, 3.0)))
    with engine.connect() as conn:
        assert conn.execute(text("SELECT sum(count) FROM invocations")).scalar() == 3 * 120 + 2 * 90 + 2 * 120
        assert conn.execute(text("SELECT burst_through FROM serving_models")).scalar() == start + timedelta(minutes=7)


@pytest.mark.parametrize(("rows", "reason", "row", "field"), [
    ([{"peak_10s": -1}], "negative_count", 1, "peak_10s"),
    ([{"peak_10s": 2.5}], "non_integer_count", 1, "peak_10s"),
    ([{"peak_10s": True}], "not_a_number", 1, "peak_10s"),
    ([{"peak_10s": "lots"}], "not_a_number", 1, "peak_10s"),
    ([{"peak_10s": None}], "nan", 1, "peak_10s"),
    ([{}, {"peak_10s": 50}], "peak_above_count", 2, "peak_10s"),
    ([{"peak_10s": 5}, {"minute": "2026-11-29T11:00:30Z"}], "peak_in_shared_minute", 1, "peak_10s"),
    ([{"peak_10s": 5, "minute": "yesterday"}], "bad_timestamp", 1, "minute"),
    ([{"peak": 5}], "unknown_field", 1, "peak"),
])
def test_a_bad_pushed_peak_is_a_422_naming_row_and_field_and_nothing_is_written(client, tokens, engine, rows,
                                                                                  reason, row, field):
    put_model(client, tokens)
    base = {"model_id": "llama", "minute": "2026-11-29T11:00:00Z", "count": 40}
    batch = [{**base, "minute": f"2026-11-29T11:0{k}:00Z", **r} for k, r in enumerate(rows)]
    response = client.post("/v1/invocations", json={"rows": batch}, headers=auth(tokens["ingest"]))
    assert response.status_code == 422, response.text
    body = response.json()
    assert (body["reason"], body["row"], body["field"]) == (reason, row, field)
    if field == "peak_10s" and reason not in ("peak_above_count", "peak_in_shared_minute"):
        assert "peak_10s" in body["detail"] and "count" not in body["detail"].split(": ", 1)[-1]
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM invocations")).scalar() == 0
        assert conn.execute(text("SELECT burst_factor FROM serving_models WHERE id = 'llama'")).scalar() is None


def _drop_the_day_after_ensure_partitions(monkeypatch) -> None:
    """Retention drops the batch's day between ensure_partitions (which found or made it) and the write."""
    from forecaster.store import invocations
    from forecaster.store.retention import drop_day

    real = invocations.ensure_partitions

    def racing(engine, start, end, **kwargs):
        created = real(engine, start, end, **kwargs)
        drop_day(engine, start.astimezone(timezone.utc).date())
        return created

    monkeypatch.setattr(invocations, "ensure_partitions", racing)


def test_a_day_dropped_under_a_push_is_created_again(client, tokens, engine, monkeypatch):
    """The COPY used to fail with psycopg's CheckViolation ("no partition of relation invocations found for row"),
    which no handler knew: a 500. The write creates a missing partition after taking its days' locks."""
    put_model(client, tokens)
    _drop_the_day_after_ensure_partitions(monkeypatch)
    rows = [{"model_id": "llama", "minute": "2026-11-29T11:00:00Z", "count": 3}]
    response = client.post("/v1/invocations", json={"rows": rows}, headers=auth(tokens["ingest"]))
    assert response.status_code == 200, response.text
    with engine.connect() as conn:
        assert conn.execute(text("SELECT sum(count) FROM invocations")).scalar() == 3


def test_a_database_error_inside_the_copy_is_answered_like_any_other(client, tokens, engine, monkeypatch):
    """A psycopg error raised through the raw COPY cursor is a DBAPIError, so the API answers 503 naming the
    SQLSTATE (not a 500), as for any statement."""
    from forecaster.store import invocations

    put_model(client, tokens)
    _drop_the_day_after_ensure_partitions(monkeypatch)
    monkeypatch.setattr(invocations, "create_missing_partitions", lambda conn, days: [], raising=False)
    rows = [{"model_id": "llama", "minute": "2026-11-29T11:00:00Z", "count": 3}]
    response = client.post("/v1/invocations", json={"rows": rows}, headers=auth(tokens["ingest"]))
    assert response.status_code == 503, response.text
    assert (response.json()["reason"], response.json()["sqlstate"]) == ("database_refused", "23514")
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM invocations")).scalar() == 0
