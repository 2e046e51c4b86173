"""Burst factors (forecaster.contracts.bursts): one definition for the simulator's serving layer, the per-request
trace readers and the catalogue, and the plan job sizing replicas by the stored value."""

from __future__ import annotations

import csv
from collections import Counter
from datetime import datetime

import numpy as np
import pandas as pd
import pytest
from sqlalchemy import text
from typer.testing import CliRunner

from forecaster.cli import app
from forecaster.contracts.bursts import BURST_ALPHA, MAX_BURST_FACTOR, burst_factors, update_burst_factor
from forecaster.data import AZURE_LLM2023_CODE_HEAD, sample_path
from forecaster.ingest.service import ingest_trace_file
from forecaster.ingest.traces import read_trace
from forecaster.jobs.planning import fleet_from_store, plan_job
from forecaster.simulation.engine import FleetSimulator
from forecaster.store.catalog import ServingModelSpec, upsert_models
from tests.test_plan_job import NOW, _setup
from tests.test_simulator import CONFIG, FloorSchedule, one_model, workload


def test_even_arrivals_read_one_and_a_minute_in_one_bucket_moves_towards_six():
    even = np.arange(0, 300, 1.0) + 0.5  # 60 a minute, 10 in every 10-second bucket
    bunched = np.concatenate([m * 60 + np.linspace(0.5, 9.5, 30) for m in range(5)])  # 30 a minute, in 10 s
    factors = burst_factors(np.array(["even"] * len(even) + ["bunched"] * len(bunched)),
                            np.concatenate([even, bunched]))
    assert factors["even"] == pytest.approx(1.0)
    # five busy minutes at ratio 6, from 1: 6 - 5 (1 - a)^5
    assert factors["bunched"] == pytest.approx(MAX_BURST_FACTOR - 5 * (1 - BURST_ALPHA) ** 5)
    assert 1.0 < factors["bunched"] < MAX_BURST_FACTOR


def test_minutes_with_few_requests_measure_nothing():
    assert burst_factors(np.array(["quiet"] * 19), np.linspace(0.5, 5.0, 19)) == {}
    assert burst_factors(np.array([], dtype=object), np.array([])) == {}


def test_the_batch_reading_equals_the_running_update_minute_by_minute():
    rng = np.random.default_rng(3)
    times = np.sort(np.concatenate([rng.uniform(m * 60, m * 60 + rng.uniform(5, 60), rng.integers(0, 80))
                                    for m in range(30)]))
    running = np.ones(1)
    for m in range(30):
        in_minute = times[(times >= m * 60) & (times < (m + 1) * 60)]
        buckets = Counter(np.floor((in_minute - m * 60) / 10).astype(int))
        running = update_burst_factor(running, np.array([float(len(in_minute))]),
                                      np.array([float(max(buckets.values(), default=0))]))
    assert burst_factors(np.array(["m"] * len(times)), times)["m"] == pytest.approx(running[0])
    assert running[0] > 1.2  # the draws are bursty: the check is not 1 == 1


def test_the_simulators_serving_layer_measures_the_same_factor():
    rng = np.random.default_rng(5)
    # four minutes, each with its requests inside a random stretch; .33 keeps them off the 0.1 s ticks' edges
    times = np.sort(np.concatenate([np.floor(rng.uniform(m * 60, m * 60 + rng.uniform(10, 60), 40)) + 0.33
                                    for m in range(4)]))
    sim = FleetSimulator(workload(times, 360.0), one_model(50.0), FloorSchedule(lambda t: 1), CONFIG)
    sim.run()
    expected = burst_factors(np.array(["m"] * len(times)), times)["m"]
    assert sim.burst[0] == pytest.approx(expected) and expected > 1.2


def test_the_llm_trace_reader_measures_the_factor_from_the_timestamps():
    with open(sample_path(AZURE_LLM2023_CODE_HEAD), newline="") as fh:
        stamps = pd.to_datetime([r["TIMESTAMP"] for r in csv.DictReader(fh)], utc=True)
    seconds = (stamps - pd.Timestamp("1970-01-01", tz="UTC")).total_seconds().to_numpy()
    minute = np.floor(seconds / 60)
    running = 1.0
    for m in np.unique(minute):  # the running update written out, independently of the reader's vector form
        inside = seconds[minute == m]
        if len(inside) >= 20:
            peak = max(Counter(np.floor((inside - m * 60) / 10)).values())
            running = (1 - BURST_ALPHA) * running + BURST_ALPHA * peak * 6 / len(inside)
    trace = read_trace(sample_path(AZURE_LLM2023_CODE_HEAD))
    assert trace.burst_factors == {"azure-llm-code": pytest.approx(running)}
    assert running > 1.05


def test_ingesting_a_per_request_trace_stores_the_factor_the_plan_job_reads(engine, settings):
    result = ingest_trace_file(engine, settings, sample_path(AZURE_LLM2023_CODE_HEAD),
                               now=datetime.fromisoformat("2026-11-29T00:00:00+00:00"), register=True)
    measured = read_trace(sample_path(AZURE_LLM2023_CODE_HEAD)).burst_factors["azure-llm-code"]
    assert result.burst_factors_stored == 1 and result.as_dict()["burst_factors_stored"] == 1
    with engine.connect() as conn:
        stored = conn.execute(text("SELECT burst_factor FROM serving_models WHERE id = 'azure-llm-code'")).scalar()
    assert stored == pytest.approx(measured)
    fleet = fleet_from_store(engine, now=NOW)
    assert fleet.models.loc["azure-llm-code", "burst_factor"] == pytest.approx(measured)


def test_a_model_without_a_factor_is_planned_as_even_and_a_bursty_one_for_its_bursts_queue(engine, settings):
    _setup(engine)

    def max_replicas() -> int:
        plan_job(engine, settings, NOW)
        with engine.begin() as conn:
            specs = conn.execute(text("SELECT spec FROM actions WHERE kind = 'scale' AND model_id = 'llama'")).all()
            conn.execute(text("DELETE FROM actions"))
            conn.execute(text("DELETE FROM plans"))
        return max(s[0]["replicas"] for s in specs)

    assert fleet_from_store(engine, now=NOW).models.loc["llama", "burst_factor"] == 1.0
    even = max_replicas()
    with engine.begin() as conn:
        conn.execute(text("UPDATE serving_models SET burst_factor = 3 WHERE id = 'llama'"))
    bursty = max_replicas()
    # at three times the mean rate for 10 s a replica takes a third of the minute's requests: sized for the
    # peak, 8 -> 23, cut to the 21 the GPU budget allows (3 nodes x 8 GPUs, less the 10 % headroom left to the
    # reactive path). At cold cost 1 a few seconds of queue behind the burst cost less than the last replicas.
    assert even >= 5 and 2 * even <= bursty < 21
    with engine.begin() as conn:
        conn.execute(text("UPDATE serving_models SET labels = labels || '{\"cold_cost\": 1000}' WHERE id = 'llama'"))
    assert max_replicas() == 21  # a second of wait is worth more than any replica: sized for the peak


@pytest.mark.parametrize("value", [0.5, 6.5, float("nan")])
def test_a_declared_factor_outside_one_to_six_is_refused_everywhere(engine, settings, value, monkeypatch):
    with pytest.raises(ValueError, match="burst_factor"):
        ServingModelSpec(id="m", burst_factor=value)
    with engine.begin() as conn, pytest.raises(Exception, match="burst_factor_range"):
        conn.execute(text("INSERT INTO serving_models (id, burst_factor) VALUES ('m', :v)"), {"v": value})
    monkeypatch.setenv("DATABASE_URL", settings.database_url)
    out = CliRunner().invoke(app, ["models", "register", "m", "--burst-factor", str(value)])
    assert out.exit_code == 2 and "burst_factor" in out.output


def test_the_api_takes_a_declared_factor_and_refuses_one_out_of_range(engine, settings):
    from fastapi.testclient import TestClient

    from api.main import create_app
    from forecaster.store.tokens import create_token

    admin = {"Authorization": f"Bearer {create_token(engine, name='a', scopes=['admin'])}"}
    with TestClient(create_app(settings, engine, clock=lambda: NOW)) as client:
        ok = client.put("/v1/models/llm", json={"replica_rps": 2.0, "burst_factor": 2.5}, headers=admin)
        assert ok.status_code == 200 and ok.json()["burst_factor"] == 2.5
        bad = client.put("/v1/models/llm", json={"burst_factor": 7}, headers=admin)
        assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["body", "burst_factor"]
        assert client.get("/v1/models/llm", headers=admin).json()["burst_factor"] == 2.5
    with engine.begin() as conn:
        upsert_models(conn, [ServingModelSpec(id="llm", replica_rps=2.0)])  # a PUT replaces the spec
    assert fleet_from_store(engine, now=NOW).models.loc["llm", "burst_factor"] == 1.0


def _fluid_wait_by_steps(replicas, n, burst, rps, d, dt=0.001):
    """The wait of :func:`_burst_queue_wait` integrated in small time steps: arrivals at the burst's rate for
    10 s and at the rest's for 50, service at ``replicas x rps``, ``d / 2`` per request queued at 60 s."""
    queue, area = 0.0, 0.0
    rest = n * max(1.0 - burst / 6.0, 0.0) / 50.0
    for k in range(int(round(60.0 / dt))):
        rate = n * burst / 60.0 if k * dt < 10.0 else rest
        queue = max(queue + (rate - replicas * rps) * dt, 0.0)
        area += queue * dt
    return area + queue * d / 2.0


@pytest.mark.parametrize(("replicas", "n", "burst", "rps"), [
    (4, 600, 3.0, 2.4),  # queue drains in the minute
    (2, 600, 3.0, 2.4),  # below the mean rate: requests left at the minute's end
    (10, 600, 3.0, 2.4),  # the peak is served: no queue
    (3, 300, 6.0, 2.4),  # the whole minute in one bucket
    (5, 700, 1.5, 2.4),  # a mild burst that drains late
])
def test_the_burst_queues_closed_form_is_the_fluid_queue(replicas, n, burst, rps):
    from forecaster.planning.planner import _burst_queue_wait

    closed = float(_burst_queue_wait(np.array(float(replicas)), np.array(float(n)), np.array(burst),
                                     np.array(rps), np.array(40.0)))
    assert closed == pytest.approx(_fluid_wait_by_steps(replicas, n, burst, rps, 40.0), rel=2e-3, abs=0.5)


def test_bursty_sizes_are_the_cheapest_between_even_and_peak():
    """The bisection finds the size a search of every size finds, and that size lies between the even-arrival
    and the peak-rate sizes; a dearer wait never asks for fewer replicas."""
    from forecaster.planning.planner import ForecastArrays, _burst_queue_sizes, _burst_queue_wait

    rng = np.random.default_rng(7)
    levels = np.array([0.1, 0.5, 0.9, 0.99])
    b, h = 40, 3
    base = rng.uniform(20, 900, size=(b, h, 1))
    values = np.sort(base * rng.uniform(0.5, 2.0, size=(b, h, len(levels))), axis=2)
    fa = ForecastArrays(levels=levels, values=values, p_any=rng.uniform(0.3, 1.0, (b, h)), known=np.ones(b, bool))
    burst, rps, d = rng.uniform(1.1, 6.0, b), np.full(b, 2.4), rng.uniform(5, 90, b)
    c_idle = np.full(b, 60.0)
    even = np.ceil(values[..., 2] / (rps[:, None] * 60.0))
    peak = np.ceil(values[..., 3] * burst[:, None] / (rps[:, None] * 60.0))
    rows = np.ones(b, dtype=bool)
    sizes = {}
    for cost in (0.25, 1.0, 4.0, 64.0):
        costs = np.full(b, cost)
        sizes[cost] = got = _burst_queue_sizes(fa, rows, even, peak, burst, rps, costs, d, c_idle)
        assert ((got >= np.minimum(even, peak)) & (got <= peak)).all()
        counts = np.stack([fa.quantile(1.0 - fa.p_any * (j + 0.5) / 16) for j in range(16)], axis=2)
        lo = np.minimum(even, peak)
        best, best_total = lo.copy(), np.full(lo.shape, np.inf)
        for r in range(int(lo.min()), int(peak.max()) + 1):
            r_arr = np.full(lo.shape, float(r))
            wait = _burst_queue_wait(r_arr[..., None], counts, burst[:, None, None], rps[:, None, None],
                                     d[:, None, None]).mean(axis=2)
            total = r * c_idle[:, None] + cost * fa.p_any * wait
            take = (r_arr >= lo) & (r_arr <= peak) & (total < best_total - 1e-9)
            best, best_total = np.where(take, r_arr, best), np.where(take, total, best_total)
        np.testing.assert_array_equal(got, best)
    assert all((sizes[a] <= sizes[c]).all() for a, c in ((0.25, 1.0), (1.0, 4.0), (4.0, 64.0)))
    assert (sizes[0.25] < peak).any() and (sizes[64.0] > sizes[0.25]).any()
