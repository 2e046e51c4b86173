"""The latency model between its nightly refits, against a real PostgreSQL: new cold starts reach the plan job's
table and the API (the champion observes them), a fresh install's prior champion is replaced once starts arrive,
and a model without registered sizes is predicted from its own starts (else the default), never the 0-byte prior."""

from __future__ import annotations

from datetime import timedelta

import pandas as pd
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text

from api.main import create_app
from forecaster.coldstart import service
from forecaster.coldstart.service import ensure_latency_model, train_latency_model
from forecaster.contracts.phases import START_STATES
from forecaster.ingest.service import push_cold_starts
from forecaster.jobs.planning import fleet_from_store, predicted_latency
from forecaster.planning.lead_time import start_seconds_by_state
from forecaster.store.catalog import ServingModelSpec, upsert_models
from forecaster.store.registry import champion_version
from forecaster.store.tokens import create_token
from tests.test_lead_time import NOW, SMALL_TREES


def _forget_process_state() -> None:
    """What another process (or this one after a restart) starts with: nothing loaded, observed or cached."""
    with service._lock:
        service._models.clear()
        service._failed_loads.clear()
        service._tables.clear()
        getattr(service, "_observed_models", {}).clear()


def _nodes(engine, *nodes: str) -> None:
    with engine.begin() as conn:
        for node in nodes:
            conn.execute(text("INSERT INTO nodes (id, gpus_total, gpus_free) VALUES (:n, 8, 8)"), {"n": node})


def _starts(model: str, node: str, seconds: float, state: str | None, *, first, n: int, every_min: int = 7):
    return [{"model_id": model, "node_id": node, "started_at": (first + timedelta(minutes=every_min * k)).isoformat(),
             "total_seconds": seconds, **({} if state is None else {"cache_state": state})} for k in range(n)]


def _planned(engine, settings, model: str) -> dict[str, float]:
    """The plan job's latency input for ``model``, reduced per tier as the planner reduces it."""
    fleet = fleet_from_store(engine, now=NOW)
    table = predicted_latency(engine, fleet, now=NOW, settings=settings)
    row = start_seconds_by_state(table, [model], fleet).loc[model]
    return {s: float(row[s]) for s in START_STATES}


@pytest.fixture
def sized(engine, settings):
    """Model a (sizes registered) with 60 cold starts on n1 and n2 over the day before, a champion trained 3 h ago."""
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id="a", image_ref="reg.example/a:1", image_size_bytes=int(10e9),
                                              weights_uri="s3://w/a", weights_size_bytes=int(16e9),
                                              replica_rps=2.0)])
    _nodes(engine, "n1", "n2")
    first = NOW - timedelta(hours=27)
    events = []
    for k, state in enumerate(("none", "image", "disk", "host") * 15):
        seconds = {"none": 150.0, "image": 110.0, "disk": 60.0, "host": 20.0}[state] * (1 + 0.03 * (k % 5))
        events += _starts("a", f"n{k % 2 + 1}", seconds, state, first=first + timedelta(minutes=20 * k), n=1)
    push_cold_starts(engine, settings, events, now=NOW)
    _forget_process_state()
    return train_latency_model(engine, settings, NOW - timedelta(hours=3), tree_params=SMALL_TREES)


def test_new_cold_starts_reach_the_plan_table_before_the_nightly_refit(engine, settings, sized):
    """A degraded node: twenty 600 s starts from disk on n1 since the champion was trained. The plan job's table
    (and so the API's lead time) shows them within the hour, not a day later; a process that starts afresh
    answers the same; a start after the hour's cutoff waits for the next hour's table."""
    before = _planned(engine, settings, "a")
    slow = _starts("a", "n1", 600.0, "disk", first=NOW - timedelta(hours=2, minutes=40), n=20)
    push_cold_starts(engine, settings, slow, now=NOW)
    after = _planned(engine, settings, "a")
    assert champion_version(engine, kind="latency").id == sized  # no refit
    assert after["disk"] > 1.5 * before["disk"], (before, after)
    _forget_process_state()  # another process: loads the champion, observes the same rows, same numbers
    assert _planned(engine, settings, "a") == pytest.approx(after, rel=1e-6)
    # a start after this hour's cutoff (11:55 for the 12:00 table) is in the next hour's table, not this one
    late = _starts("a", "n1", 900.0, "disk", first=NOW - timedelta(minutes=2), n=1)
    push_cold_starts(engine, settings, late, now=NOW)
    assert _planned(engine, settings, "a") == pytest.approx(after, rel=1e-6)


def test_a_fresh_installs_prior_champion_is_replaced_once_cold_starts_arrive(engine, settings):
    """The first plan trains the first champion on no cold starts (the physics prior); once the store holds
    ``min_events`` starts, the next plan's ensure_latency_model trains one that learned from them."""
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id="a", image_size_bytes=int(10e9), weights_size_bytes=int(16e9))])
    _forget_process_state()
    first = ensure_latency_model(engine, settings, NOW - timedelta(days=1))
    assert "trees" not in champion_version(engine, kind="latency").members
    assert ensure_latency_model(engine, settings, NOW - timedelta(hours=23)) == first  # nothing new: no retrain
    push_cold_starts(engine, settings, _starts("a", "n1", 400.0, "none", first=NOW - timedelta(hours=20), n=40),
                     now=NOW)
    second = ensure_latency_model(engine, settings, NOW)
    assert second != first and "trees" in champion_version(engine, kind="latency").members
    assert ensure_latency_model(engine, settings, NOW) == second


@pytest.fixture
def sizeless(engine, settings):
    """'llm' auto-registered by a push (no sizes) with 20 starts of 300 s from nothing; 'ghost' registered without
    sizes and never started; fewer than min_events starts in the fleet (the champion is the prior)."""
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id="ghost", replica_rps=1.0)])
    _nodes(engine, "n1")
    push_cold_starts(engine, settings, _starts("llm", "n1", 300.0, "none", first=NOW - timedelta(hours=21), n=20,
                                               every_min=60), now=NOW, register=True)
    _forget_process_state()
    train_latency_model(engine, settings, NOW)


def test_a_model_without_sizes_is_planned_from_its_own_starts_or_the_default(engine, settings, sizeless):
    """Not ~12 s from every tier (the 0-byte physics prior): its own starts' p90, else PREWARM_DEFAULT_COLD_START_S."""
    planned = _planned(engine, settings, "llm")
    assert planned == pytest.approx({s: 300.0 for s in START_STATES})
    assert _planned(engine, settings, "ghost") == pytest.approx({s: settings.default_cold_start_s
                                                                 for s in START_STATES})


def test_the_api_reports_where_a_sizeless_models_figures_come_from(engine, settings, sizeless):
    token = create_token(engine, name="read", scopes=["read"])
    with TestClient(create_app(settings, engine, clock=lambda: NOW)) as client:
        client.headers["Authorization"] = f"Bearer {token}"
        body = client.get("/v1/models/llm/cold-start").json()
        assert {t["tier"]: t["predicted_s"] for t in body["tiers"]} == pytest.approx({s: 300.0 for s in START_STATES})
        assert body["source"] == "observed"
        on_node = client.get("/v1/models/llm/cold-start", params={"node": "n1"}).json()
        assert on_node["predicted_start_s"] == pytest.approx(300.0) and on_node["source"] == "observed"
        ghost = client.get("/v1/models/ghost/cold-start").json()
        assert ghost["predicted_start_s"] == pytest.approx(settings.default_cold_start_s)
        assert ghost["source"] == "default"
        dashboard = client.get("/v1/models/llm/coldstarts").json()
        assert dashboard["lead_time_source"] in ("observed", "default")
        if dashboard["lead_time_source"] == "observed":
            assert dashboard["lead_time_s"] > 300.0


def test_a_sizeless_models_tiers_without_starts_never_take_a_warmer_tiers_figure(engine, settings):
    """'warm' has only GPU-resident restarts (3 s): its cold tiers are the default (45 s), not 3 s; 'hot' has
    starts from host (100 s) only: the colder tiers never plan faster than that; 'cold' has starts from nothing
    (300 s) and from host (20 s): image and disk take the colder 300 s, host keeps its own."""
    _nodes(engine, "n1")
    first = NOW - timedelta(hours=21)
    events = (_starts("warm", "n1", 3.0, "gpu", first=first, n=4)
              + _starts("hot", "n1", 100.0, "host", first=first, n=4)
              + _starts("cold", "n1", 300.0, "none", first=first, n=3)
              + _starts("cold", "n1", 20.0, "host", first=first + timedelta(minutes=3), n=3))
    push_cold_starts(engine, settings, events, now=NOW, register=True)
    _forget_process_state()
    train_latency_model(engine, settings, NOW)
    default = settings.default_cold_start_s
    assert default > 3.0
    assert _planned(engine, settings, "warm") == pytest.approx({s: default for s in START_STATES})
    assert _planned(engine, settings, "hot") == pytest.approx({"none": max(default, 100.0),
                                                               "image": max(default, 100.0),
                                                               "disk": max(default, 100.0), "host": 100.0})
    assert _planned(engine, settings, "cold") == pytest.approx({"none": 300.0, "image": 300.0, "disk": 300.0,
                                                                "host": 20.0})


def test_the_plan_and_the_next_hours_prefetch_do_not_evict_each_others_observed_rows(engine, settings, sized,
                                                                                      monkeypatch):
    """In an hour's last minutes each plan (this hour's cutoff) is followed by the next hour's prefetch (the next
    cutoff): the rows since training are read and observed once per cutoff, not twice per plan."""
    push_cold_starts(engine, settings, _starts("a", "n1", 600.0, "disk", first=NOW - timedelta(hours=2), n=5),
                     now=NOW)
    monkeypatch.setattr(service, "PREFETCH_IN_PROCESS", False)
    reads = []
    real = service.read_cold_starts_after
    monkeypatch.setattr(service, "read_cold_starts_after", lambda *a, **kw: reads.append(kw) or real(*a, **kw))
    models = pd.DataFrame({"image_bytes": [10e9], "weights_bytes": [16e9]}, index=pd.Index(["a"]))
    last_minutes = NOW.replace(minute=55)
    tables = []
    for minute in range(5):
        now = last_minutes + timedelta(minutes=minute)
        tables.append(service.latency_table(engine, settings, models, hour=now.hour, now=now))
        service.prefetch_next_hour(engine, settings, models, now=now)
        assert service.wait_for_prefetches(60)
    assert len(reads) == 2, reads  # one per cutoff (this hour's, the next hour's)
    assert all(t.equals(tables[0]) for t in tables)


def _slow_start_committed_after_training(engine, settings):
    """A 900 s start from disk whose id is taken before a later row's (the later one commits first), a champion
    trained between the two commits, then the slow row committed: the id order is not the commit order."""
    conn = engine.connect()
    tx = conn.begin()
    conn.execute(text("INSERT INTO cold_starts (model_id, node_id, started_at, total_seconds, cache_state, source) "
                      "VALUES ('a', 'n1', :t, 900, 'disk', 'push')"), {"t": NOW - timedelta(hours=2)})
    slow_id = conn.execute(text("SELECT currval(pg_get_serial_sequence('cold_starts', 'id'))")).scalar_one()
    push_cold_starts(engine, settings, _starts("a", "n2", 40.0, "host", first=NOW - timedelta(hours=2, minutes=1),
                                               n=1), now=NOW)
    _forget_process_state()
    train_latency_model(engine, settings, NOW - timedelta(minutes=30), tree_params=SMALL_TREES)
    tx.commit()
    conn.close()
    return slow_id


def test_a_start_whose_lower_id_commits_after_the_training_is_observed(engine, settings, sized):
    """Its id is below the training's watermark, but the training could not see it: it is a recorded gap, observed
    once committed (before, it waited for the next refit), by this process and by one that loads the champion."""
    slow_id = _slow_start_committed_after_training(engine, settings)
    _, model = service.latency_model_at(engine, settings, now=NOW)
    assert (model.history_["total_seconds"] == 900.0).sum() == 1
    assert slow_id <= model.through_id_ and slow_id in model.gap_ids_
    trained = service._current(engine, settings, service.FleetConfig())[1]
    assert len(model.history_) == len(trained.history_) + 1
    _forget_process_state()  # another process: the champion as saved knows its gaps too
    _, again = service.latency_model_at(engine, settings, now=NOW)
    assert (again.history_["total_seconds"] == 900.0).sum() == 1 and len(again.history_) == len(model.history_)


def test_too_many_gaps_fall_back_to_re_reading_the_span_without_observing_a_row_twice(engine, settings, sized,
                                                                                     monkeypatch):
    """More ids below the watermark unseen than the cap (here 0): the rows above the span's floor are read again and
    those the champion holds are dropped by key; the late row is observed once."""
    from forecaster.store import coldstarts

    monkeypatch.setattr(coldstarts, "MAX_GAPS", 0, raising=False)
    slow_id = _slow_start_committed_after_training(engine, settings)
    _, model = service.latency_model_at(engine, settings, now=NOW)
    assert (model.history_["total_seconds"] == 900.0).sum() == 1
    assert model.gap_ids_ is None and model.gap_floor_id_ < slow_id
    trained = service._current(engine, settings, service.FleetConfig())[1]
    assert len(model.history_) == len(trained.history_) + 1  # the 900 s row, nothing trained on twice
