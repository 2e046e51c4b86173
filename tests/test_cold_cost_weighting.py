"""The plan step's cold-cost weighting (PREWARM_PLANNER_COLD_COST_WEIGHTING): the rate it reads, the weights, the
decisions they change, and the rate's way from the forecast job through the store to the plan job."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import numpy as np
import pandas as pd
import pytest

from forecaster.contracts.fleet import build_fleet
from forecaster.contracts.forecast import (
    REQUEST_RATE_COLUMN,
    TrailingRequestRates,
    history_request_rate_rpm,
    with_request_rates,
)
from forecaster.contracts.phases import START_STATES
from forecaster.planning.fleet import PlannerSettings
from forecaster.planning.step import plan_step, planner_settings, weighted_cold_costs
from forecaster.settings import Settings, SettingsError, load_settings

NOW = datetime(2026, 12, 7, 12, 0, tzinfo=timezone.utc)


def test_the_history_rate_counts_known_minutes_only_and_never_reaches_zero():
    counts = np.array([[0.0, 2.0, np.nan, 4.0], [np.nan] * 4, [0.0] * 4])
    np.testing.assert_allclose(history_request_rate_rpm(counts), [7.0 / 4.0, 1.0, 1.0 / 5.0])
    big = np.random.default_rng(1).poisson(0.3, (9000, 30)).astype(float)  # across the 4,096-row blocks
    big[::7, ::3] = np.nan
    known = ~np.isnan(big)
    np.testing.assert_allclose(history_request_rate_rpm(big),
                               (np.where(known, big, 0).sum(axis=1) + 1) / (known.sum(axis=1) + 1))
    with pytest.raises(ValueError):
        history_request_rate_rpm(np.zeros(5))


def test_the_replays_running_rate_is_the_history_rate_of_the_same_window():
    counts = np.random.default_rng(2).poisson(1.5, (20, 300)).astype(float)
    for lookback in (60, 1440):
        rates = TrailingRequestRates(counts, lookback)
        for minute in (0, 1, 59, 60, 61, 299, 300):
            window = counts[:, max(0, minute - lookback):minute]
            np.testing.assert_allclose(rates.at(minute), history_request_rate_rpm(window))
    forecast = pd.DataFrame({"unique_id": ["m2", "m0", "m2", "gone"], "q0.5": 0.0})
    frame = with_request_rates(forecast, [f"m{i}" for i in range(3)], [0.5, 1.5, 2.5])
    np.testing.assert_array_equal(frame[REQUEST_RATE_COLUMN].to_numpy()[:3], [2.5, 0.5, 2.5])
    assert np.isnan(frame[REQUEST_RATE_COLUMN].iloc[3]) and REQUEST_RATE_COLUMN not in forecast  # not mutated


def test_weights_scale_by_the_mean_rate_over_each_models_own():
    cold = np.array([1.0, 2.0, 1.0, 1.0])
    rate = np.array([0.01, 1.0, 10.0, np.nan])
    mean = (0.01 + 1.0 + 10.0) / 3
    np.testing.assert_allclose(weighted_cold_costs(cold, rate, "model"),
                               [mean / 0.01, 2.0 * mean / 1.0, mean / 10.0, 1.0])  # unknown rate: weight 1
    known = np.isfinite(rate)
    weights = weighted_cold_costs(np.ones(4), rate, "model")
    assert (weights[known] * rate[known]).sum() == pytest.approx(rate[known].sum())  # traffic keeps its weight
    np.testing.assert_array_equal(weighted_cold_costs(cold, rate, "request"), cold)
    np.testing.assert_array_equal(weighted_cold_costs(cold, np.full(4, np.nan), "model"), cold)
    np.testing.assert_allclose(weighted_cold_costs(np.array([3.0]), np.array([250.0]), "model"), [3.0])  # one model
    with pytest.raises(ValueError):
        weighted_cold_costs(cold, rate, "models")


def test_the_setting_reaches_the_planner_and_is_validated(monkeypatch):
    assert planner_settings(Settings()).cold_cost_weighting == "model"
    assert planner_settings(Settings(planner_cold_cost_weighting="request")).cold_cost_weighting == "request"
    monkeypatch.setenv("PREWARM_PLANNER_COLD_COST_WEIGHTING", "per-model")
    with pytest.raises(SettingsError, match="PREWARM_PLANNER_COLD_COST_WEIGHTING"):
        load_settings()


def _plan(rates: list[float] | None, weighting: str, p_any: float = 0.2):
    """One minute-protocol plan (60 s cold starts, 1 GPU a replica) of two models with the same ``p_any``."""
    ids = ["rare", "busy"]
    levels = (0.1, 0.5, 0.9, 0.99)
    forecast = pd.DataFrame({"unique_id": ids, "ds": NOW, "p_any": p_any,
                             **{f"q{lv}": float(lv >= 1.0 - p_any) for lv in levels}})
    if rates is not None:
        forecast[REQUEST_RATE_COLUMN] = rates
    models = pd.DataFrame({"image_ref": None, "image_bytes": 0.0, "weights_uri": None, "weights_bytes": 0.0,
                           "gpus": 1.0, "replica_rpm": 1e12, "slo_s": np.nan, "cold_cost": 1.0, "replicas": 0},
                          index=pd.Index(ids, name="model_id"))
    nodes = pd.DataFrame({"gpus_free": [1e6], "host_free_bytes": [0.0], "disk_free_bytes": [0.0]},
                         index=pd.Index(["n"], name="node_id"))
    latency = pd.DataFrame([{"model_id": i, "state": s, "total_s": 60.0} for i in ids for s in START_STATES])
    settings = PlannerSettings(horizon_min=1, tiers=False, count_queued_wait=False, lead_margin_s=0.0,
                               lead_margin_frac=0.0, replica_utilisation=1.0, cold_cost_weighting=weighting)
    result = plan_step(NOW, forecast, build_fleet(models, nodes), latency, settings)
    return sorted(a.model_id for a in result.actions if a.replicas)


def test_model_weighting_holds_the_rarely_called_model_the_request_weighting_leaves_cold():
    """p_any 0.2, cold start 60 s, 1 GPU: held when 0.2 x 60 x cost >= 0.8 x 60, i.e. at a cost of 4 or more.
    Rates 0.01 and 1.99 a minute (mean 1): weights 100 and about 0.5."""
    assert _plan([0.01, 1.99], "request") == []
    assert _plan([0.01, 1.99], "model") == ["rare"]
    assert _plan(None, "model") == []  # no rates with the forecast: cold costs as given
    assert _plan([1.0, 1.0], "model") == []  # equal rates: weights 1


def test_the_rate_goes_from_the_stored_run_to_the_plan_job_as_the_replay_gives_it(engine):
    from forecaster.jobs.planning import stored_forecast
    from forecaster.store.catalog import ServingModelSpec, upsert_models
    from forecaster.store.forecasts import read_newest_runs, write_forecast_arrays, write_forecasts

    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id=m) for m in ("llama", "mistral", "phi")])
    first = NOW + timedelta(minutes=1)
    point = np.array([[1.0, 2.0], [0.0, 0.5], [3.0, 3.0]])
    columns = {"point": point, "p_any": np.full_like(point, 0.5), "q0.5": point, "q0.9": point + 1}
    write_forecast_arrays(engine, ["llama", "mistral", "phi"], first, columns, issued_at=NOW, model_version_id=None,
                          request_rate_rpm=np.array([12.5, 0.0125, np.nan]))
    with engine.connect() as conn:
        runs = read_newest_runs(conn, with_request_rate=True)
        plain = read_newest_runs(conn)
    stored = dict(zip(runs.model_ids, runs.request_rate_rpm))
    assert stored["llama"] == pytest.approx(12.5) and stored["mistral"] == pytest.approx(0.0125, rel=1e-6)
    assert np.isnan(stored["phi"]) and plain.request_rate_rpm is None
    frame = stored_forecast(engine, now=first, horizon_min=2)
    by_model = frame.groupby("unique_id")[REQUEST_RATE_COLUMN].agg(["min", "max"])
    assert by_model.loc["llama"].tolist() == pytest.approx([12.5, 12.5])
    assert np.isnan(by_model.loc["phi", "min"])
    # the long-frame path keeps a model's first row's rate; a bad rate names its model and writes nothing
    frame = pd.DataFrame({"unique_id": ["llama", "llama"], "ds": [first, first + timedelta(minutes=1)],
                          "point": [1.0, 2.0], "q0.5": [1.0, 2.0], REQUEST_RATE_COLUMN: [0.75, 0.75]})
    write_forecasts(engine, frame, issued_at=NOW + timedelta(seconds=1), model_version_id=None)
    with engine.connect() as conn:
        assert dict(zip(*(lambda r: (r.model_ids, r.request_rate_rpm))(
            read_newest_runs(conn, with_request_rate=True))))["llama"] == pytest.approx(0.75)
    for bad in (-1.0, np.inf, 1e300):
        with pytest.raises(ValueError, match="'llama'.*request_rate_rpm"):
            write_forecasts(engine, frame.assign(**{REQUEST_RATE_COLUMN: bad}),
                            issued_at=NOW + timedelta(seconds=2), model_version_id=None)
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM forecasts").scalar() == 4  # 3 + the frame's 1


def test_the_replay_gives_the_forecast_the_rate_the_forecast_job_would_store():
    from forecaster.contracts.fleetconfig import FleetConfig
    from forecaster.planning.forecasts import CountPanel
    from forecaster.simulation.catalog import assign_models
    from forecaster.simulation.engine import FleetSimulator
    from forecaster.simulation.policies import PlannerPolicy
    from forecaster.simulation.runner import LatencyInput
    from forecaster.simulation.workload import Workload

    counts = np.random.default_rng(3).poisson([[0.05], [4.0], [0.5]], (3, 100)).astype(float)
    ids = np.array(["a", "b", "c"], dtype=object)
    workload = Workload.from_counts(CountPanel(ids=ids, start=pd.Timestamp(NOW), counts=counts))
    config = FleetConfig(n_nodes=2, score_from_s=0.0, phase_noise_sigma=0.0)
    product = Settings(forecast_lookback_min=60)
    seen = []

    class Source:
        def quantiles(self, now, horizon_min):
            return pd.DataFrame({"unique_id": np.repeat(ids, horizon_min), "ds": now, "q0.5": 0.0, "p_any": 0.0})

    policy = PlannerPolicy(Source(), LatencyInput(config), planner_settings(product), product=product)
    original = policy.with_request_rates
    policy.with_request_rates = lambda forecast, view: seen.append((view.minute, original(forecast, view))) \
        or seen[-1][1]
    FleetSimulator(workload, assign_models(workload.ids, order_by=counts.sum(axis=1)), policy, config).run()
    assert len(seen) >= 95 and {m for m, _ in seen} >= {0, 59, 60, 61, 99}
    for minute, frame in seen:
        window = counts[:, max(0, minute - 60):minute]
        expected = dict(zip(ids, history_request_rate_rpm(window)))
        for model_id, rate in frame.groupby("unique_id")[REQUEST_RATE_COLUMN].first().items():
            assert rate == pytest.approx(expected[model_id])
