"""The fleet simulator against hand-computed cases, and the policies on tiny traces with exact cold starts.

Cold starts here come from host memory with no noise, so every start takes
exactly ``D = weights / host-to-GPU bandwidth + runtime start + registration``.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from forecaster.coldstart.physics import physics_latency_table
from forecaster.planning.fleet import PlannerSettings
from forecaster.planning.forecasts import OracleForecast
from forecaster.simulation.catalog import AZURE_SHARES, assign_models, load_catalog
from forecaster.contracts.fleetconfig import FleetConfig
from forecaster.simulation.engine import Decision, FleetSimulator
from forecaster.simulation.policies import HybridHistogramPolicy, KeepAlivePolicy, KnativePolicy, PlannerPolicy
from forecaster.simulation.workload import Workload

START = pd.Timestamp("2026-01-05", tz="UTC")
# D = 12 GB / 12 GB/s (1 s) + 2.7 + 1.6 + 5.7 (10 s) + 2 s = 13 s
CONFIG = FleetConfig(n_nodes=2, engine_warmup_s=5.7, registration_s=2.0, phase_noise_sigma=0.0, tick_s=0.1,
                     peak_slowdown=1.0)
D = 13.0


def one_model(rps: float, gpus: int = 1) -> pd.DataFrame:
    return pd.DataFrame({"image_ref": ["vllm/vllm-openai:latest"], "image_bytes": [12e9],
                         "weights_uri": ["s3://weights/m"], "weights_bytes": [12e9], "gpus": [gpus],
                         "replica_rps": [rps], "request_s": [2.0]}, index=pd.Index(["m"], name="model_id"))


def workload(times: list[float] | np.ndarray, duration_s: float) -> Workload:
    times = np.asarray(times, dtype="float64")
    return Workload.from_requests(np.array(["m"], dtype=object), np.zeros(len(times), dtype=np.int64), times, START,
                                  duration_s=duration_s)


class FloorSchedule:
    """A policy that holds ``floor(t)`` replicas; no reactive overload path, so only the formula acts."""

    name = "schedule"
    decide_every_s = 0.1
    idle_grace_s = 0.0
    reactive_overload = False

    def __init__(self, floor):
        self.floor = floor

    def decide(self, view):
        return Decision(floor=np.array([self.floor(view.now_s)]))


def simulate(wl: Workload, models: pd.DataFrame, policy, config: FleetConfig = CONFIG, state: str = "host"):
    sim = FleetSimulator(wl, models, policy, config)
    for node in range(config.n_nodes):
        sim.warm_cache(node, 0, state)
    return sim, sim.run()


# --------------------------------------------------------------------------- hand-computed bursts


def test_cold_start_from_host_memory_takes_the_phase_sum():
    sim, result = simulate(workload([5.0], 60.0), one_model(10.0), KeepAlivePolicy(1))
    (event,) = result.events.itertuples()
    assert event.cache_state == "host"
    assert event.total_seconds == pytest.approx(D, abs=0.11)
    assert event.weight_load_s == pytest.approx(1.0, abs=0.11) and event.image_pull_s == 0.0
    assert result.waits[0] == pytest.approx(D, abs=0.2)


def test_burst_from_nothing_backlog_and_waits_match_the_fluid_formula():
    """lambda = 5/s from t = 0, no replica: backlog lambda*D, wait of a request arriving at a = D - a(1 - lambda/mu)."""
    lam, mu = 5.0, 10.0
    times = np.arange(300) / lam
    sim, result = simulate(workload(times, 120.0), one_model(mu), KeepAlivePolicy(1))
    assert result.cold_requests[0] == lam * D  # every request before the replica is ready: 65
    expected = np.maximum(D - times * (1 - lam / mu), 0.0)
    assert np.abs(result.waits - expected).max() < 0.25
    assert result.summary()["wait_max_s"] == pytest.approx(D, abs=0.2)
    # the backlog drains at mu - lambda: empty at D + lambda*D/(mu - lambda) = 26 s
    assert (result.waits[times > 26.2] < 0.2).all()


def test_burst_with_one_ready_replica_backlog_is_lambda_minus_n_mu_times_d():
    """n = 1 ready (mu = 10/s), lambda = 15/s from t = 100 s, a second replica starts at 100 s and takes D = 13 s."""
    lam, mu, t0 = 15.0, 10.0, 100.0
    times = t0 + np.arange(int(lam * 60)) / lam
    policy = FloorSchedule(lambda t: 1 if t < t0 else 2)
    sim, result = simulate(workload(times, 200.0), one_model(mu), policy)
    backlog = (lam - mu) * D  # 65 requests waiting when the second replica becomes ready
    a = times - t0
    ahead = (lam - mu) * a  # queued ahead of a request arriving at a < D
    served_by_d = mu * (D - a)
    before = np.where(ahead <= served_by_d, ahead / mu, (D - a) + (ahead - served_by_d) / (2 * mu))
    after = np.maximum(backlog - (2 * mu - lam) * (a - D), 0.0) / (2 * mu)
    expected = np.where(a < D, before, after)
    assert np.abs(result.waits - expected).max() < 0.25
    # the unlucky request arrives at mu D / lambda (the queue ahead of it is just served by D) and waits
    # (lambda - mu) D / lambda: proportional to D
    worst = a[np.argmax(result.waits)]
    assert worst == pytest.approx(mu * D / lam, abs=0.2)
    assert result.summary()["wait_max_s"] == pytest.approx((lam - mu) * D / lam, abs=0.15)
    drained = D + backlog / (2 * mu - lam)  # 26 s after the burst began
    assert (result.waits[a > drained + 0.2] < 0.15).all()
    assert result.cold_requests[0] == 0  # a replica was ready all along: queueing, not cold starts


def test_gpu_seconds_allocated_and_busy():
    """One request at t = 10 s on a 2-GPU model, 2-minute keep-alive: the replica lives from 10 s to 10 s + 120 s."""
    mu = 4.0
    sim, result = simulate(workload([10.0], 300.0), one_model(mu, gpus=2), KeepAlivePolicy(2, decide_every_s=0.1))
    assert result.gpu_seconds == pytest.approx(2 * 120.0, abs=2 * 0.2)
    assert result.busy_gpu_seconds == pytest.approx(2 / mu)
    assert result.summary()["wasted_gpu_seconds"] == pytest.approx(240.0 - 0.5, abs=0.5)


class GraceSchedule(FloorSchedule):
    """No floor; the serving layer's reactive path and a grace of ``idle_grace_s``, as the planner's policy has."""

    reactive_overload = True
    idle_grace_s = 60.0


def test_the_grace_keeps_the_last_replica_not_a_burst_s_extra_ones():
    """A 30-second burst at 1.5x one replica's rate starts a second replica; then a request every 20 s keeps the
    model serving until 300 s. The grace keeps the last replica until 60 s after it served (360 s), but the
    second stops once the burst's rate has passed: the model still serving is no reason to hold it (before, it was
    held to 360 s as well, about twice the GPU-seconds)."""
    mu = 10.0
    burst = 10.0 + np.arange(450) / 15.0
    times = np.concatenate([burst, np.arange(60.0, 301.0, 20.0)])
    sim, result = simulate(workload(times, 500.0), one_model(mu), GraceSchedule(lambda t: 0))
    assert result.replica_starts == 2
    one_replica = 360.0 - 10.0  # from the burst's first request to 60 s after the last one served
    assert one_replica < result.gpu_seconds < one_replica + 90.0
    assert sim.ready[0] + sim.starting[0] == 0  # gone 60 s after the last request


# --------------------------------------------------------------------------- policies on a tiny trace


TINY = [130.0, 400.0, 1000.0]


def latency_input(config):
    return lambda view: physics_latency_table(view.models, config=config)


@pytest.mark.parametrize(
    "policy, cold",
    [
        (KeepAlivePolicy(5), 2),  # 130 cold; 400 within 5 min; 1000 is 600 s after 400: cold
        (KeepAlivePolicy(10), 1),
        (HybridHistogramPolicy(), 1),  # fewer than 5 idle times: a 4-hour keep-alive
        (KnativePolicy(), 3),  # 60 s stable window + 30 s grace: gone before each next request
        ("oracle", 0),  # knows minutes 2, 6 and 16 and starts a lead time ahead
    ],
)
def test_policies_on_a_tiny_trace_have_exact_cold_starts(policy, cold):
    wl = workload(TINY, 1200.0)
    config = FleetConfig(n_nodes=2, engine_warmup_s=5.7, phase_noise_sigma=0.0, tick_s=1.0, peak_slowdown=1.0)
    if policy == "oracle":
        policy = PlannerPolicy(OracleForecast(wl.panel), latency_input(config), PlannerSettings(), name="oracle")
    _, result = simulate(wl, one_model(10.0), policy, config=config)
    assert int(result.cold_requests.sum()) == cold
    assert result.requests.sum() == 3


def test_every_policy_plans_through_the_same_interface_and_scored_window():
    wl = workload(np.arange(0, 1200, 7.0), 1200.0)
    config = FleetConfig(n_nodes=2, phase_noise_sigma=0.0, tick_s=1.0, score_from_s=600.0)
    for policy in (KeepAlivePolicy(10), HybridHistogramPolicy(), KnativePolicy(),
                   PlannerPolicy(OracleForecast(wl.panel), latency_input(config), name="oracle")):
        _, result = simulate(wl, one_model(10.0), policy, config=config, state="none")
        assert result.requests.sum() == (wl.times >= 600).sum()
        assert len(result.waits) == result.requests.sum()
        assert 0 < result.gpu_seconds <= 600.0 * 8 * 2


# --------------------------------------------------------------------------- transfers, caches, catalogue


def test_cold_start_from_nothing_pulls_fetches_and_shares_bandwidth():
    """Two models start together on a one-node fleet: their pulls share the NIC/registry, phases add up."""
    config = FleetConfig(n_nodes=1, phase_noise_sigma=0.0, tick_s=0.5, peak_slowdown=1.0,
                         image_pull_bytes_per_s=1e9, node_nic_bytes_per_s=1e9, registry_bytes_per_s=1e12,
                         weight_fetch_bytes_per_s=1e9, engine_warmup_s=5.7)
    models = pd.DataFrame({"image_ref": ["img/a:1", "img/b:1"], "image_bytes": [10e9, 10e9],
                           "weights_uri": ["s3://w/a", "s3://w/b"], "weights_bytes": [4e9, 4e9],
                           "gpus": [1, 1], "replica_rps": [5.0, 5.0], "request_s": [1.0, 1.0]},
                          index=pd.Index(["a", "b"], name="model_id"))
    wl = Workload.from_requests(np.array(["a", "b"], dtype=object), np.array([0, 1]), np.array([1.0, 1.0]), START,
                                duration_s=300.0)
    sim = FleetSimulator(wl, models, KeepAlivePolicy(5), config)
    result = sim.run()
    events = result.events.set_index("model_id")
    # both 10 GB pulls share 1 GB/s: 20 s each; then both 4 GB fetches share it: 8 s; load 4 GB at 2 GB/s: 2 s
    for m in ("a", "b"):
        assert events.loc[m, "image_pull_s"] == pytest.approx(20.0, abs=0.6)
        assert events.loc[m, "weight_fetch_s"] == pytest.approx(8.0, abs=0.6)
        assert events.loc[m, "weight_load_s"] == pytest.approx(2.0, abs=0.6)
        assert events.loc[m, "total_seconds"] == pytest.approx(20 + 8 + 2 + 10 + 2, abs=1.1)
    assert result.peak_concurrent_pulls == 2
    assert result.bytes_registry == 20e9 and result.bytes_object_store == 8e9


def test_catalogue_sizes_are_cited_and_the_azure_mapping_uses_every_entry():
    catalog = load_catalog()
    assert len(catalog) == 10 and catalog["weights_source"].str.len().gt(10).all()
    assert catalog["image_source"].str.contains("issue #").all()
    assert set(AZURE_SHARES) == set(catalog.index)
    ids = np.array([f"f{i}" for i in range(200)], dtype=object)
    memory = np.arange(200, dtype=float)
    table = assign_models(ids, order_by=memory)
    assert set(table["catalog_name"]) == set(catalog.index)
    # bigger memory, bigger model
    assert table.loc["f0", "weights_bytes"] < table.loc["f199", "weights_bytes"]
    assert table["weights_uri"].is_unique


def test_advance_in_steps_measures_what_one_run_measures():
    """The demo advances the simulator minute by minute; that must be the same replay as ``run()``."""
    rng = np.random.default_rng(3)
    times = np.sort(rng.uniform(0.0, 600.0, 400))
    whole = FleetSimulator(workload(times, 600.0), one_model(2.0), KnativePolicy(), CONFIG).run()
    stepped = FleetSimulator(workload(times, 600.0), one_model(2.0), KnativePolicy(), CONFIG)
    for until in (59.95, 60.0, 130.0, 300.0, 600.0, 700.0):
        stepped.advance(until)
    assert stepped.now == pytest.approx(600.0)
    result = stepped.result()
    assert result.replica_starts == whole.replica_starts > 0
    assert result.cold_requests.tolist() == whole.cold_requests.tolist()
    np.testing.assert_allclose(result.waits, whole.waits)
    assert result.gpu_seconds == pytest.approx(whole.gpu_seconds)


@pytest.mark.parametrize("start", ["2019-07-15 13:47", "2026-03-29 00:00", "2026-10-25 23:59"])
def test_hour_of_a_simulated_moment_is_the_timestamp_hour(start):
    """The simulator's hour of day (peak-hour transfer rates, the cold-start events' ``hour``) is read from the
    start's offset into its day; it must be the hour pandas gives ``start + seconds``, at hour boundaries too."""
    ids = np.array(["a"], dtype=object)
    workload = Workload.from_requests(ids, np.zeros(1, dtype=np.int64), np.array([0.5]), pd.Timestamp(start, tz="UTC"),
                                      duration_s=3 * 86400.0)
    sim = FleetSimulator(workload, assign_models(ids), KeepAlivePolicy(10), FleetConfig(n_nodes=1))
    begin = pd.Timestamp(start, tz="UTC")
    to_boundary = 3600.0 - (begin.minute * 60 + begin.second)
    moments = [0.0, 0.25, to_boundary - 1e-3, to_boundary, to_boundary + 1e-3, 86399.5, 86400.0, 2 * 86400 + 7.25]
    moments += list(np.random.default_rng(0).uniform(0, 3 * 86400.0, 200))
    for seconds in moments:
        assert sim._hour_at(seconds) == (begin + pd.Timedelta(seconds=seconds)).hour, seconds


def test_a_p99_resting_on_one_burst_says_so():
    """Steady traffic served at once, then one burst from nothing in minute 3: every request at or above the p99
    arrived in that minute, and without it the p99 is the steady traffic's (no wait)."""
    steady = np.arange(60.0, 600.0, 0.5)  # 2/s, one replica held ready: no waits
    burst = 200.0 + np.arange(40) * 0.01  # 40 requests in 0.4 s: 2 % of the run, queued behind one replica
    times = np.sort(np.concatenate([steady, burst]))
    _, result = simulate(workload(times, 660.0), one_model(10.0), FloorSchedule(lambda t: 1))
    summary = result.summary()
    assert summary["wait_p99_s"] > 1.0
    assert summary["wait_p99_top_minute_share"] == 1.0
    assert summary["wait_p99_without_top_minute_s"] == pytest.approx(0.0, abs=0.15)
    assert (result.wait_minute == (times // 60).astype(int)).all()


def test_wait_tail_with_no_wait_or_no_request():
    from forecaster.simulation.engine import wait_tail

    assert wait_tail(np.zeros(5), np.arange(5)) == {"wait_p99_top_minute_share": 0.0,
                                                     "wait_p99_without_top_minute_s": 0.0}
    assert wait_tail(np.zeros(0), np.zeros(0, dtype=int))["wait_p99_top_minute_share"] == 0.0
    # the tail split over two minutes, 3 of 4 in minute 7
    waits = np.concatenate([np.zeros(396), [5.0, 6.0, 7.0, 8.0]])
    minutes = np.concatenate([np.arange(396) % 5, [7, 7, 7, 2]])
    out = wait_tail(waits, minutes)
    assert out["wait_p99_top_minute_share"] == pytest.approx(0.75)
