"""``GET /v1/replays/latest`` against a real PostgreSQL: one page of models, totals summed by the database.

The per-model rows and totals must be what the former path gave (every outcome row read and summed in Python,
kept here as the reference); ``limit`` (default 100) and ``offset`` page the models by id; ``count`` counts
them all; the totals cover every model whatever the page or ``model_id``.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text

from api.main import create_app
from forecaster.store.replays import OUTCOME_COLUMNS, start_replay, write_replay_outcomes
from forecaster.store.tokens import create_token

END = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)
NOW = END + timedelta(seconds=30)
MODELS = ["m-3", "m-1", "org/model", "Zeta", "ΟΔΟΣ-7b", "m-10", "m-2"]


def figures(i: int, policy: str) -> dict:
    """Distinct per model and policy; waits in quarters, so sums are exact in any order."""
    k = {"prewarm": 1, "reactive": 3, "hybrid": 5}[policy]
    return {"requests": 100 * (i + 1), "cold_requests": (7 * i + k) % 50, "replica_starts": i + k,
            "wait_total_s": 0.25 * (13 * i + 11 * k), "wait_max_s": 0.5 * ((i * k) % 9)}


def store(engine, outcomes: dict[str, list[dict]], window_end: datetime = END) -> int:
    with engine.begin() as conn:
        replay = start_replay(conn, source="demo", window_start=window_end - timedelta(hours=6),
                              window_end=window_end, policies=("prewarm", "reactive"))
        write_replay_outcomes(conn, replay_id=replay, scored_until=window_end, summary={"cluster": {"nodes": 2}},
                              outcomes=outcomes)
    return replay


def old_answer(conn, replay_id: int, model_id: str | None = None) -> dict:
    """What the route answered before paging, without ``limit``: every row read, summed and filtered in Python."""
    subject, baseline = "prewarm", "reactive"
    rows = conn.execute(text(
        f"SELECT policy, model_id, {', '.join(OUTCOME_COLUMNS)} FROM replay_outcomes WHERE replay_id = :r "
        "ORDER BY model_id, policy"), {"r": replay_id}).mappings().all()
    zero = {"requests": 0, "cold_requests": 0, "replica_starts": 0, "wait_total_s": 0.0, "wait_max_s": 0.0}
    totals = {subject: dict(zero), baseline: dict(zero)}
    by_model: dict[str, dict] = {}
    for row in rows:
        got = {c: row[c] for c in OUTCOME_COLUMNS}
        total = totals.setdefault(row["policy"], dict(zero))
        for c in OUTCOME_COLUMNS[:4]:
            total[c] += got[c]
        total["wait_max_s"] = max(total["wait_max_s"], got["wait_max_s"])
        by_model.setdefault(row["model_id"], {})[row["policy"]] = got
    data = []
    for mid, policies in by_model.items():
        if model_id is not None and mid != model_id:
            continue
        mine, theirs = policies.get(subject, zero), policies.get(baseline, zero)
        data.append({"model_id": mid, "prewarm": mine, "reactive": theirs,
                     "cold_requests_avoided": theirs["cold_requests"] - mine["cold_requests"],
                     "wait_saved_s": theirs["wait_total_s"] - mine["wait_total_s"]})
    return {"count": len(data), "data": data, "totals": totals}


@pytest.fixture
def client(engine, settings):
    token = create_token(engine, name="read", scopes=["read"])
    with TestClient(create_app(settings, engine, clock=lambda: NOW)) as client:
        client.headers["Authorization"] = f"Bearer {token}"
        yield client


@pytest.fixture
def small_replay(engine):
    """Seven models under both policies and a third one; a model only the baseline saw, one only the third did."""
    store(engine, {"prewarm": [{"model_id": "old", **figures(0, "prewarm")}]}, window_end=END - timedelta(days=1))
    outcomes = {policy: [{"model_id": m, **figures(i, policy)} for i, m in enumerate(MODELS)]
                for policy in ("prewarm", "reactive", "hybrid")}
    outcomes["reactive"].append({"model_id": "baseline-only", **figures(8, "reactive")})
    outcomes["hybrid"].append({"model_id": "hybrid-only", **figures(9, "hybrid")})
    return store(engine, outcomes)


def test_rows_and_totals_are_the_former_paths(client, engine, small_replay):
    with engine.connect() as conn:
        expected = old_answer(conn, small_replay)
        one = old_answer(conn, small_replay, model_id="org/model")
    assert expected["count"] == len(MODELS) + 2 and set(expected["totals"]) == {"prewarm", "reactive", "hybrid"}
    body = client.get("/v1/replays/latest", params={"limit": 1000}).json()
    assert body["replay"]["id"] == small_replay
    assert (body["count"], body["data"], body["replay"]["totals"]) == (
        expected["count"], expected["data"], expected["totals"])
    assert body == client.get("/v1/replays/latest").json()  # nine models fit the default page
    only = client.get("/v1/replays/latest", params={"model_id": "org/model"}).json()
    assert (only["count"], only["data"], only["replay"]["totals"]) == (1, one["data"], expected["totals"])
    # the fleet's call: totals only, every model counted
    totals = client.get("/v1/replays/latest", params={"limit": 0}).json()
    assert (totals["count"], totals["data"], totals["replay"]) == (expected["count"], [], body["replay"])
    # a model the replay does not hold: no row, the totals still there
    none = client.get("/v1/replays/latest", params={"model_id": "nope"}).json()
    assert (none["count"], none["data"], none["replay"]["totals"]) == (0, [], expected["totals"])


def test_pages_of_models_by_limit_and_offset(client, engine, small_replay):
    whole = client.get("/v1/replays/latest", params={"limit": 1000}).json()
    pages = [client.get("/v1/replays/latest", params={"limit": 4, "offset": o}).json() for o in (0, 4, 8, 12)]
    assert [p["count"] for p in pages] == [whole["count"]] * 4
    assert [len(p["data"]) for p in pages] == [4, 4, 1, 0]
    assert [r for p in pages for r in p["data"]] == whole["data"]
    assert all(p["replay"] == whole["replay"] for p in pages)  # totals whatever the page
    assert client.get("/v1/replays/latest", params={"model_id": "m-1", "offset": 1}).json()["data"] == []
    assert client.get("/v1/replays/latest", params={"offset": -1}).status_code == 422


def test_the_default_page_is_a_hundred_models_and_the_totals_cover_all(client, engine):
    n = 250
    replay = store(engine, {"prewarm": [], "reactive": []})
    with engine.begin() as conn:  # 250 models under both policies, one request each, a cold one under reactive
        conn.execute(text(
            "INSERT INTO replay_outcomes (replay_id, policy, model_id, requests, cold_requests, replica_starts, "
            "wait_total_s, wait_max_s) SELECT :r, p, 'model-' || lpad(g::text, 4, '0'), 1, "
            "CASE WHEN p = 'reactive' THEN 1 ELSE 0 END, 0, g, 1.5 FROM generate_series(1, :n) g, "
            "unnest(ARRAY['prewarm', 'reactive']) p"), {"r": replay, "n": n})
    body = client.get("/v1/replays/latest").json()
    assert body["count"] == n and len(body["data"]) == 100
    assert [r["model_id"] for r in body["data"]] == [f"model-{g:04d}" for g in range(1, 101)]
    rest = client.get("/v1/replays/latest", params={"offset": 200}).json()
    assert [r["model_id"] for r in rest["data"]] == [f"model-{g:04d}" for g in range(201, n + 1)]
    assert body["replay"]["totals"] == {
        "prewarm": {"requests": n, "cold_requests": 0, "replica_starts": 0, "wait_total_s": n * (n + 1) / 2,
                    "wait_max_s": 1.5},
        "reactive": {"requests": n, "cold_requests": n, "replica_starts": 0, "wait_total_s": n * (n + 1) / 2,
                     "wait_max_s": 1.5}}
    assert body["data"][0]["cold_requests_avoided"] == 1 and body["data"][0]["wait_saved_s"] == 0.0
