"""The replayed loop is the production loop: causal forecasts, the plan job's plan step, the actuator's guardrails.

(a) a replay whose trace is altered after minute t makes identical decisions up to t (empirical and ensemble);
(b) the plan job (fed by the store) and the simulator (fed by the simulated cluster) plan the same actions from
    the same fleet, forecast and latency;
(c) in a replay the actuator's GPU budget is never exceeded, and the kill switch stops every action.
"""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pandas as pd
import pytest
from sqlalchemy import text

from forecaster.contracts.fleetconfig import FleetConfig
from forecaster.contracts.forecast import FORECAST_LEVELS, quantile_column
from forecaster.forecast.members import MovingAverage
from forecaster.jobs.planning import fleet_from_store, plan_job, predicted_latency, stored_forecast
from forecaster.planning.forecasts import CountPanel
from forecaster.planning.step import plan_step, planner_settings
from forecaster.settings import Settings
from forecaster.simulation.catalog import assign_models
from forecaster.simulation.engine import FleetSimulator
from forecaster.simulation.policies import PlannerPolicy
from forecaster.simulation.runner import ForecastSources, LatencyInput
from forecaster.simulation.workload import Workload
from forecaster.store.actions import list_actions
from forecaster.store.catalog import ServingModelSpec, upsert_models
from forecaster.store.forecasts import write_forecasts

START = pd.Timestamp("2026-01-05", tz="UTC")
MINUTES = 150
CONFIG = FleetConfig(n_nodes=3, score_from_s=30 * 60.0, phase_noise_sigma=0.0)


def bursty_counts(seed: int = 7, n: int = 6) -> np.ndarray:
    """Per-minute counts: a timer every 15 minutes, a diurnal-ish level, and quiet models."""
    rng = np.random.default_rng(seed)
    t = np.arange(MINUTES)
    counts = np.zeros((n, MINUTES))
    counts[0] = np.where(t % 15 == 0, 400, 0)
    counts[1] = rng.poisson(30 + 25 * np.sin(t / 20.0))
    counts[2] = rng.poisson(0.2, MINUTES)
    counts[3] = np.where((t // 30) % 2 == 1, rng.poisson(120, MINUTES), 0)
    counts[4:] = rng.poisson(2.0, (n - 4, MINUTES))
    return counts


def replay(counts: np.ndarray, *, forecaster: str = "empirical", product: Settings | None = None,
           check=None) -> PlannerPolicy:
    ids = np.array([f"model-{i}" for i in range(len(counts))], dtype=object)
    panel = CountPanel(ids=ids, start=START, counts=counts)
    workload = Workload.from_counts(panel)
    models = assign_models(workload.ids, order_by=counts.sum(axis=1))
    # a 15-minute forecast horizon lets the ensemble fit after 60 minutes (4 horizons) of a 150-minute replay
    product = product or Settings(forecast_horizon_min=15)
    sources = ForecastSources(workload.panel, train_until_min=60, retrain_every_min=45,
                              members=[MovingAverage(window=15)], settings=product)
    policy = PlannerPolicy(sources.get(forecaster), LatencyInput(CONFIG), planner_settings(product), cold_cost=4.0,
                           product=product, record_plans=True)
    if check is not None:
        decide = policy.decide

        def checked(view):
            out = decide(view)
            check(policy, view)
            return out

        policy.decide = checked
    FleetSimulator(workload, models, policy, CONFIG).run()
    policy.sources = sources
    return policy


def decisions(policy: PlannerPolicy, until: pd.Timestamp) -> list[tuple]:
    return [(p.planned_at, tuple(a.to_spec().items() for a in p.actions)) for p in policy.plans
            if pd.Timestamp(p.planned_at) <= until]


@pytest.mark.parametrize("forecaster", ["empirical", "ensemble"])
def test_a_replay_altered_after_minute_t_decides_the_same_up_to_t(forecaster):
    t = 100
    counts = bursty_counts()
    altered = counts.copy()
    altered[:, t:] = np.random.default_rng(99).poisson(300, altered[:, t:].shape)
    first = replay(counts, forecaster=forecaster)
    second = replay(altered, forecaster=forecaster)
    cut = START + timedelta(minutes=t)
    assert decisions(first, cut) == decisions(second, cut)
    assert sum(len(p.actions) for p in first.plans) > 0  # the replay acted at all
    # ... and the alteration matters afterwards (the comparison could tell a difference)
    assert decisions(first, START + timedelta(minutes=MINUTES)) != decisions(second, START + timedelta(minutes=MINUTES))
    if forecaster == "ensemble":
        source = first.sources.get("ensemble")
        assert source.retrains == 2 and source.schedule == [60, 105]  # retrained in simulated time, before and after t


def test_the_plan_job_and_the_simulator_plan_the_same_from_the_same_inputs(engine, settings):
    counts = bursty_counts()
    ids = np.array([f"model-{i}" for i in range(len(counts))], dtype=object)
    workload = Workload.from_counts(CountPanel(ids=ids, start=START, counts=counts))
    models = assign_models(workload.ids, order_by=counts.sum(axis=1))
    policy = PlannerPolicy(None, LatencyInput(CONFIG), planner_settings(settings), cold_cost=settings.planner_cold_cost,
                           product=settings)
    sim = FleetSimulator(workload, models, policy, CONFIG)
    sim.warm_cache(0, 1, "disk")
    sim.warm_cache(1, 3, "host")
    sim.warm_cache(2, 0, "image")
    now = START.to_pydatetime()
    sim_fleet = policy.fleet(sim.view, now)
    # the same fleet in the store: catalogue, nodes, what each node holds
    inputs = sim.fleet_inputs()
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(
            id=str(i), image_ref=row.image_ref, image_size_bytes=int(row.image_bytes), weights_uri=row.weights_uri,
            weights_size_bytes=int(row.weights_bytes), gpus_per_replica=int(row.gpus), replica_rps=float(row.replica_rps))
            for i, row in models.iterrows()])
        for node_id, node in inputs["nodes"].iterrows():
            conn.execute(text("INSERT INTO nodes (id, gpus_total, gpus_free, disk_free_bytes, host_memory_free_bytes) "
                              "VALUES (:n, 8, :g, :d, :h)"),
                         {"n": node_id, "g": int(node.gpus_free), "d": int(node.disk_free_bytes),
                          "h": int(node.host_free_bytes)})
        for a in inputs["artefacts"].itertuples(index=False):
            conn.execute(text("INSERT INTO node_cache (node_id, artefact_kind, ref, tier) VALUES (:n, :k, :r, :t)"),
                         {"n": a.node_id, "k": a.kind, "r": a.ref, "t": a.tier})
    # a forecast of values float32 stores exactly: a spike for two models in minute 3
    minutes = pd.date_range(START, periods=60, freq="min")
    rows = []
    for k, model_id in enumerate(ids):
        level = np.where(np.arange(60) >= 3, [64.0, 256.0, 0.0, 128.0, 2.0, 2.0][k], 0.0)
        frame = {"unique_id": model_id, "ds": minutes, "point": level, "p_any": np.where(level > 0, 1.0, 0.25)}
        for q in FORECAST_LEVELS:
            frame[quantile_column(q)] = level * (1.0 + q)
        rows.append(pd.DataFrame(frame))
    write_forecasts(engine, pd.concat(rows), issued_at=now - timedelta(seconds=30), model_version_id=None)
    store_fleet = fleet_from_store(engine, now=now, default_cold_cost=settings.planner_cold_cost)
    forecast = stored_forecast(engine, now=now, horizon_min=settings.plan_horizon_min)
    latency = predicted_latency(engine, store_fleet, now=now)
    pd.testing.assert_frame_equal(store_fleet.cache.sort_values(["node_id", "model_id"]).reset_index(drop=True),
                                  sim_fleet.cache.sort_values(["node_id", "model_id"]).reset_index(drop=True))
    from_sim = plan_step(now, forecast, sim_fleet, latency, planner_settings(settings))
    from_store = plan_step(now, forecast, store_fleet, latency, planner_settings(settings))
    assert from_sim.actions and from_sim.actions == from_store.actions
    # and the plan job itself (store -> plan step -> actuator) records exactly those actions
    plan_job(engine, settings, now)
    recorded = sorted((a["spec"]["kind"], a["spec"]["model_id"], a["spec"]["node_id"] or "", a["spec"]["replicas"] or 0)
                      for a in list_actions(engine))
    planned = sorted((str(a.kind), a.model_id, a.node_id or "", a.replicas or 0) for a in from_sim.actions)
    assert recorded == planned


def test_a_replay_never_exceeds_the_gpu_budget():
    budget = 2
    product = Settings(actuator_gpu_budget=budget)
    peaks = []

    def check(policy, view):
        held = policy.actuation.ledger.ahead_gpus_total()
        peaks.append(held)
        assert held <= budget

    policy = replay(bursty_counts(), product=product, check=check)
    report = policy.actuation.report()
    assert max(peaks) > 0  # scale-ahead did hold GPUs ...
    assert report["guardrail_refusals"].get("gpu_budget", 0) + \
        report["guardrail_refusals"].get("gpu_budget_clamped", 0) > 0  # ... and the budget had to refuse some


def test_the_kill_switch_stops_every_action_in_a_replay():
    product = Settings(actuator_kill_switch=True)
    floors = []
    policy = replay(bursty_counts(), product=product,
                    check=lambda policy, view: floors.append(int(policy.actuation.actuator.backend.sim.floor.sum())))
    report = policy.actuation.report()
    assert report["by_status"].get("dropped", 0) > 0
    assert set(report["by_status"]) == {"dropped"}
    assert report["guardrail_refusals"] == {"kill_switch": report["by_status"]["dropped"]}
    assert max(floors) == 0  # nothing the planner asked reached the cluster


def test_a_latency_input_shared_by_runs_gives_each_run_its_own_tables():
    """The benchmarks replay every policy with one latency input: a run must not inherit the table the previous run
    cached at its end (its clock starts at 0 again, so a cache keyed on time alone served that table all day)."""
    counts = bursty_counts()
    ids = np.array([f"model-{i}" for i in range(len(counts))], dtype=object)
    workload = Workload.from_counts(CountPanel(ids=ids, start=START, counts=counts))
    models = assign_models(workload.ids, order_by=counts.sum(axis=1))
    product = Settings(forecast_horizon_min=15)

    class RecordingLatency(LatencyInput):
        """Physics latency, recording the simulated second of every table it makes."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.made: list[float] = []

        def __call__(self, view):
            before = self._cached
            table = super().__call__(view)
            if table is not before:
                self.made.append(view.now_s)
            return table

    def run(latency: LatencyInput):
        source = ForecastSources(workload.panel, train_until_min=60, settings=product).get("empirical")
        policy = PlannerPolicy(source, latency, planner_settings(product), cold_cost=4.0, product=product,
                               record_plans=True)
        FleetSimulator(workload, models, policy, CONFIG).run()
        return decisions(policy, START + timedelta(minutes=MINUTES))

    shared = RecordingLatency(CONFIG, refresh_s=600.0)
    first = run(shared)
    made_first = list(shared.made)
    shared.made.clear()
    second = run(shared)
    # every run refreshes on its own clock: at its start and every 10 simulated minutes
    assert made_first == shared.made and made_first[0] == 0.0 and len(made_first) >= MINUTES // 10
    assert first == second == run(LatencyInput(CONFIG))
