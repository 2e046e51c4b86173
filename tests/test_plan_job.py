"""The plan job end to end on a real store: forecasts + fleet + latency model -> planner -> dry-run actuator."""

from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone

import pandas as pd
import pytest
from sqlalchemy import text

from forecaster.coldstart.service import train_latency_model
from forecaster.contracts.actions import Reason
from forecaster.store.catalog import ServingModelSpec, upsert_models
from forecaster.store.forecasts import write_forecasts
from forecaster.jobs.planning import fleet_from_store, plan_job, stored_forecast

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)


def _setup(engine, spike_at: int = 4):
    with engine.begin() as conn:
        upsert_models(conn, [
            ServingModelSpec(id="llama", image_ref="vllm/vllm-openai:v0.5.4", image_size_bytes=9 * 10**9,
                             weights_uri="s3://models/llama", weights_size_bytes=16 * 10**9, replica_rps=2.0),
            ServingModelSpec(id="idle", image_ref="vllm/vllm-openai:v0.5.4", image_size_bytes=9 * 10**9,
                             weights_uri="s3://models/idle", weights_size_bytes=2 * 10**9, replica_rps=2.0),
        ])
        for i in range(3):
            conn.execute(text("INSERT INTO nodes (id, gpus_total, gpus_free, disk_free_bytes, host_memory_free_bytes) "
                              "VALUES (:n, 8, 8, 2e12, 5e11)"), {"n": f"gpu-{i}"})
        conn.execute(text("INSERT INTO node_cache (node_id, artefact_kind, ref, tier) "
                          "VALUES ('gpu-0', 'image', 'vllm/vllm-openai:v0.5.4', 'image')"))
    minutes = pd.date_range(NOW, periods=60, freq="min")
    busy = [0.0] * spike_at + [600.0] * (60 - spike_at)
    frame = pd.concat([
        pd.DataFrame({"unique_id": "llama", "ds": minutes, "point": busy, "p_any": [0.05] * spike_at +
                      [1.0] * (60 - spike_at), "q0.1": busy, "q0.5": busy, "q0.9": [v * 1.2 for v in busy]}),
        pd.DataFrame({"unique_id": "idle", "ds": minutes, "point": 0.0, "p_any": 0.0, "q0.1": 0.0, "q0.5": 0.0,
                      "q0.9": 0.0}),
    ])
    write_forecasts(engine, frame, issued_at=NOW - timedelta(seconds=20), model_version_id=None)


def test_stored_forecast_and_fleet_are_in_the_planners_format(engine):
    _setup(engine)
    forecast = stored_forecast(engine, now=NOW, horizon_min=10)
    assert set(forecast.columns) >= {"unique_id", "ds", "p_any", "q0.1", "q0.5", "q0.9"}
    assert len(forecast) == 20 and forecast["ds"].min() == pd.Timestamp(NOW)
    fleet = fleet_from_store(engine, now=NOW)
    assert fleet.models.loc["llama", "replica_rpm"] == 120.0 and list(fleet.nodes.index) == ["gpu-0", "gpu-1", "gpu-2"]
    assert fleet.images.to_dict("records") == [{"node_id": "gpu-0", "image_ref": "vllm/vllm-openai:v0.5.4"}]


def test_plan_job_scales_ahead_of_the_spike_and_records_every_action(engine, settings):
    _setup(engine)
    result = plan_job(engine, settings, NOW)
    assert result["actions"] > 0
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT kind, model_id, reason, status, spec FROM actions")).all()
    assert {r[1] for r in rows} == {"llama"}  # nothing for the model forecast to stay idle
    assert all(r[2] in {reason.value for reason in Reason} for r in rows)
    scales = [r for r in rows if r[0] == "scale"]
    # 600 requests/min * 1.2 at q0.9 against 120 per replica (at 80% use): several replicas, before minute 4
    assert scales and max(r[4]["replicas"] for r in scales) >= 5
    assert all(pd.Timestamp(r[4]["deadline"]) <= pd.Timestamp(NOW + timedelta(minutes=10)) for r in scales)
    assert {r[3] for r in rows} <= {"succeeded", "pending"}  # dry-run carries out what is due, the rest waits
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM plans")).scalar() == 1


def test_plan_job_without_forecasts_does_nothing(engine, settings):
    assert plan_job(engine, settings, NOW) == {"skipped": "no forecasts yet"}


def test_what_the_actuator_did_is_not_planned_again(engine, settings):
    _setup(engine)
    first = plan_job(engine, settings, NOW)
    with engine.connect() as conn:
        warmed = conn.execute(text("SELECT count(*) FROM actions WHERE kind IN ('prepull', 'preload') "
                                   "AND status = 'succeeded'")).scalar()
    second = plan_job(engine, settings, NOW + timedelta(minutes=1))
    with engine.connect() as conn:
        again = conn.execute(text("SELECT count(*) FROM actions WHERE kind IN ('prepull', 'preload') "
                                  "AND plan_id = (SELECT max(id) FROM plans)")).scalar()
    assert warmed > 0 and first["actions"] > 0
    assert again == 0  # the images and weights it warmed a minute ago count as warm now
    assert second["actions"] < first["actions"]


def test_a_poisoned_model_and_a_poisoned_cold_start_never_stop_the_plan(engine, settings):
    """Rows stored before validation existed (or by another writer): the plan is made for the other models."""
    _setup(engine)
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id="no-image"), ServingModelSpec(id="huge", replica_rps=1.0)])
        conn.execute(text("UPDATE serving_models SET replica_rps = 'Infinity' WHERE id = 'huge'"))
        conn.execute(text("INSERT INTO cold_starts (model_id, node_id, started_at, total_seconds, cache_state, source) "
                          "VALUES ('llama', 'gpu-0', '0001-01-01T00:00:00Z', 30, 'none', 'old'), "
                          "('llama', 'gpu-1', :t, 'NaN', 'none', 'old')"), {"t": NOW - timedelta(hours=1)})
    # the latency model trains past the poisoned cold starts (the scheduler does this before the first plan) ...
    version = train_latency_model(engine, settings, NOW)
    assert version is not None
    # ... and the plan is made for every model it can use
    result = plan_job(engine, settings, NOW)
    assert result["actions"] > 0 and result["summary"]["skipped"] == 1
    assert "replica_rpm" in result["summary"]["skipped_models"]["huge"]
    with engine.connect() as conn:
        planned = {r[0] for r in conn.execute(text("SELECT DISTINCT model_id FROM actions"))}
    assert "llama" in planned and "huge" not in planned


def _planned_replicas(engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT coalesce(max((spec->>'replicas')::int), 0) FROM actions "
                                     "WHERE kind = 'scale' AND plan_id = (SELECT max(id) FROM plans)")).scalar())


def test_budget_mode_carries_its_state_from_plan_to_plan_and_measures_the_idle_replicas(engine, settings):
    """Replicas the plan job scaled up and no stored invocation used are spent idle GPU-seconds; the next plan's
    cold cost comes down (nothing was allowed: no invocations, so the keep-alive reference wasted nothing)."""
    _setup(engine)
    budgeted = settings.model_copy(update={"planner_waste_budget_pct": 100.0})
    first = plan_job(engine, budgeted, NOW)
    assert first["summary"]["budget"]["updates"] == 1 and first["summary"]["budget"]["spent_total"] == 0.0
    plan_job(engine, budgeted, NOW + timedelta(minutes=5))  # the scales ahead of the spike are due: carried out
    third = plan_job(engine, budgeted, NOW + timedelta(minutes=6))
    state = third["summary"]["budget"]
    assert state["updates"] == 3 and state["spent_total"] > 0 and state["allowed_total"] == 0.0
    assert 0 < state["factor"] < 1
    assert state["status"] == "settling" and state["over_minutes"] > 0  # over budget, for under two hours
    assert len(state["curve"]) == 25 and len(state["curve_sum"]) == 25  # each plan says what it would spend
    again = plan_job(engine, budgeted, NOW + timedelta(minutes=6, seconds=30))  # same minute: no new measurement
    assert again["summary"]["budget"]["updates"] == 3
    with engine.connect() as conn:
        stored = conn.execute(text("SELECT summary->'budget'->>'updates' FROM plans ORDER BY id")).scalars().all()
    assert stored == ["1", "2", "3", "3"]


def test_budget_mode_says_when_the_budget_cannot_be_met(engine, settings, caplog):
    """A controller at its lowest cold cost that still spends past a budget of nothing: infeasible, said once."""
    _setup(engine)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO plans (planned_at, summary) VALUES (:t, CAST(:s AS jsonb))"),
                     {"t": NOW, "s": '{"budget": {"log_factor": -6.908, "spent": 500.0, "allowed": 0.0, '
                                     '"status": "over_budget", "over_minutes": 120}}'})
    budgeted = settings.model_copy(update={"planner_waste_budget_gpu_seconds_per_hour": 0.0})
    with caplog.at_level("WARNING", logger="forecaster.jobs.planning"):
        first = plan_job(engine, budgeted, NOW + timedelta(minutes=1))
        second = plan_job(engine, budgeted, NOW + timedelta(minutes=2))
    assert first["summary"]["budget"]["status"] == second["summary"]["budget"]["status"] == "infeasible"
    assert first["summary"]["budget"]["factor"] == pytest.approx(1e-3)
    said = [r.getMessage() for r in caplog.records if "waste budget infeasible" in r.getMessage()]
    assert len(said) == 1 and "after 121 minutes over it" in said[0]


def test_budget_mode_scales_the_cold_cost_the_plan_job_plans_with(engine, settings):
    _setup(engine)
    plan_job(engine, settings, NOW)
    unbudgeted = _planned_replicas(engine)
    with engine.begin() as conn:  # a controller that has driven the cold cost a thousandfold down
        conn.execute(text("DELETE FROM actions"))
        conn.execute(text("INSERT INTO plans (planned_at, summary) VALUES (:t, CAST(:s AS jsonb))"),
                     {"t": NOW, "s": '{"budget": {"log_factor": -6.9}}'})
    budgeted = settings.model_copy(update={"planner_waste_budget_gpu_seconds_per_hour": 1.0})
    result = plan_job(engine, budgeted, NOW + timedelta(seconds=10))
    assert result["summary"]["budget"]["factor"] == pytest.approx(math.exp(-6.9))
    assert unbudgeted >= 5 and _planned_replicas(engine) < unbudgeted


def test_budget_history_api_and_metrics_follow_the_plan_jobs_state(engine, settings):
    """What an operator reads (``GET /v1/budget``, the ``prewarm_waste_budget_*`` metrics) is what the plan job
    stored: one point per measurement, whose spends add up to the state's total, each predicted by the plan
    before it at the factor it used."""
    from fastapi.testclient import TestClient

    from api.main import create_app
    from forecaster.planning.budget import BudgetState
    from forecaster.store.tokens import create_token

    _setup(engine)
    budgeted = settings.model_copy(update={"planner_waste_budget_pct": 100.0})
    results = [plan_job(engine, budgeted, NOW + timedelta(minutes=m)) for m in (0, 5, 6, 6.5, 9)]
    states = [BudgetState.from_dict(r["summary"]["budget"]) for r in results]
    token = create_token(engine, name="read", scopes=["read"])
    with TestClient(create_app(budgeted, engine, clock=lambda: NOW + timedelta(minutes=10))) as client:
        body = client.get("/v1/budget", headers={"Authorization": f"Bearer {token}"}).json()
        until_six = client.get("/v1/budget", params={"until": (NOW + timedelta(minutes=6)).isoformat()},
                            headers={"Authorization": f"Bearer {token}"}).json()
        metrics = client.get("/metrics").text
        unbudgeted = TestClient(create_app(settings, engine, clock=lambda: NOW)).get(
            "/v1/budget?limit=2", headers={"Authorization": f"Bearer {token}"}).json()
    assert body["enabled"] and body["configured"]["pct"] == 100.0 and body["configured"]["window_min"] == 240.0
    points = body["points"]
    assert [p["interval_min"] for p in points] == [1.0, 5.0, 1.0, 3.0]  # the plan at 6.5 measured nothing new
    assert sum(p["spent_gpu_s"] for p in points) == pytest.approx(states[-1].spent_total) and states[-1].spent_total > 0
    assert points[0]["predicted_gpu_s"] is None  # the first plan had no plan before it
    # each later interval was predicted by the plan before it: its curve at its factor, for the minutes measured
    for point, before in zip(points[1:], [states[0], states[1], states[3]]):
        assert point["predicted_gpu_s"] == pytest.approx(before.predicted_next_minute() * point["interval_min"])
    assert body["factor"] == pytest.approx(states[-1].factor) and body["status"] == states[-1].status
    assert body["predicted_next_minute_gpu_s"] == pytest.approx(states[-1].predicted_next_minute())
    # up to a window end: the measurements before it, and the state of the last plan before it
    assert [p["interval_min"] for p in until_six["points"]] == [1.0, 5.0]
    assert until_six["factor"] == pytest.approx(states[1].factor)
    assert until_six["as_of"].startswith("2026-11-29T12:05")
    assert f"prewarm_waste_budget_factor {states[-1].factor!r}" in metrics
    assert f'prewarm_waste_budget_status{{status="{states[-1].status}"}} 1.0' in metrics
    assert 'prewarm_waste_budget_idle_gpu_seconds_total{kind="spent"}' in metrics
    # budget mode switched off: the stored states stay readable (the newest two plans: the measurements of
    # minutes 6 and 9), and the API says the budget is not set
    assert not unbudgeted["enabled"] and unbudgeted["configured"] is None
    assert [p["interval_min"] for p in unbudgeted["points"]] == [1.0, 3.0]


def _replicas(engine) -> dict[str, int]:
    """Each model's replicas after its newest succeeded scale or release."""
    with engine.connect() as conn:
        return dict(conn.execute(text(
            "SELECT m.id, (SELECT coalesce((detail->>'replicas_after')::int, (spec->>'replicas')::int) FROM actions a "
            "WHERE a.model_id = m.id AND kind IN ('scale', 'release') AND status = 'succeeded' "
            "ORDER BY updated_at DESC, id DESC LIMIT 1) FROM serving_models m")).all())


def _busy(model: str, start: datetime, level: float = 600.0) -> pd.DataFrame:
    minutes = pd.date_range(start, periods=60, freq="min")
    return pd.DataFrame({"unique_id": model, "ds": minutes, "point": level, "p_any": 1.0, "q0.1": level,
                         "q0.5": level, "q0.9": level * 1.2})


def test_a_model_whose_forecast_ran_out_is_held_not_released(engine, settings):
    """The forecast job stopped forecasting llama (its runs fail) while it forecasts 'idle': llama's last run
    expires. Without a forecast its zero desired level is no demand: the plan job released all its replicas as
    idle_release. Now it holds them, and says so."""
    _setup(engine, spike_at=0)
    plan_job(engine, settings, NOW)
    plan_job(engine, settings, NOW + timedelta(minutes=5))
    held = _replicas(engine)["llama"]
    assert held and held >= 5
    later = NOW + timedelta(minutes=65)  # llama's run (60 target minutes from NOW) has run out
    write_forecasts(engine, _busy("idle", later, 0.0), issued_at=later - timedelta(seconds=20), model_version_id=None)
    result = plan_job(engine, settings, later)
    with engine.connect() as conn:
        llama = conn.execute(text("SELECT kind, reason FROM actions WHERE model_id = 'llama' AND plan_id = "
                                  "(SELECT max(id) FROM plans)")).all()
    assert llama == [] and _replicas(engine)["llama"] == held
    assert result["summary"]["no_forecast"] == 1 and result["summary"]["held_no_forecast"] == 1


def test_a_model_with_unusable_forecast_rows_is_held_and_one_forecast_zero_is_released(engine, settings):
    """Rows with infinite values (stored before the store refused them) make the plan step drop the model: held.
    A model whose forecast is zero is released as before."""
    _setup(engine, spike_at=0)
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id="quiet", image_ref="vllm/vllm-openai:v0.5.4", replica_rps=2.0)])
    write_forecasts(engine, _busy("quiet", NOW), issued_at=NOW - timedelta(seconds=10), model_version_id=None)
    plan_job(engine, settings, NOW)
    plan_job(engine, settings, NOW + timedelta(minutes=5))
    before = _replicas(engine)
    assert before["llama"] >= 5 and before["quiet"] >= 5
    later = NOW + timedelta(minutes=10)
    write_forecasts(engine, pd.concat([_busy("llama", later), _busy("quiet", later, 0.0).assign(p_any=0.0)]),
                    issued_at=later - timedelta(seconds=20), model_version_id=None)
    with engine.begin() as conn:
        conn.execute(text("UPDATE forecasts SET quantiles = array_fill(CAST('Infinity' AS real), ARRAY[3, 60]) "
                          "WHERE model_id = 'llama' "
                          "AND issued_at = :t"), {"t": later - timedelta(seconds=20)})
    result = plan_job(engine, settings, later + timedelta(minutes=30))  # past quiet's keep window
    assert _replicas(engine)["llama"] == before["llama"]
    with engine.connect() as conn:
        planned = conn.execute(text("SELECT model_id, kind, reason FROM actions WHERE plan_id = "
                                    "(SELECT max(id) FROM plans) AND kind IN ('scale', 'release')")).all()
    assert planned == [("quiet", "release", "idle_release")]  # (the actuator's guardrails may still drop it)
    assert "llama" in result["summary"]["skipped_models"] and result["summary"]["held_no_forecast"] == 1


def test_plan_job_marks_an_old_run_and_says_when_forecasts_expired(engine, settings, caplog):
    _setup(engine)
    with caplog.at_level("WARNING", logger="forecaster.jobs.planning"):
        fresh = plan_job(engine, settings, NOW)
        assert fresh["summary"]["forecast_age_s"] == 20.0 and fresh["summary"]["forecast_stale"] is False
        old = plan_job(engine, settings, NOW + timedelta(minutes=50))
        assert old["summary"]["forecast_age_s"] == 50 * 60 + 20.0 and old["summary"]["forecast_stale"] is True
        assert "planning from a forecast run 3020 s old" in caplog.text
        expired = plan_job(engine, settings, NOW + timedelta(minutes=61))
    assert expired["skipped"] == "forecasts expired" and expired["forecast_age_s"] == 61 * 60 + 20.0
    assert "forecasts expired" in caplog.text
