"""The minute-level protocol (EVALUATION.md section 2) on tiny traces with hand-computed cold starts and waste."""

from __future__ import annotations

import numpy as np
import pytest

from forecaster.planning.forecasts import OracleForecast
from forecaster.simulation.policies import HybridHistogram
from forecaster.simulation.minute import (hybrid_loaded, keepalive_loaded, oracle_loaded, planner_loaded,
                                          reactive_loaded, score_loaded)


def row(minutes: list[int], length: int, count: int = 1) -> np.ndarray:
    out = np.zeros(length)
    out[minutes] = count
    return out


def test_keepalive_windows_cold_minutes_and_waste():
    counts = np.vstack([row([0, 3, 20], 30), row([5], 30, count=4)])
    loaded = keepalive_loaded(counts, 5)
    assert np.flatnonzero(loaded[0]).tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 21, 22, 23, 24, 25]
    score = score_loaded(counts, np.array([100.0, 50.0]), loaded, warmup=0)
    # function 0: minutes 0 and 20 cold of 3 invocations; function 1: its one minute cold, 4 invocations
    assert score.cold_minutes == 3 and score.invocations == 7
    assert score.cold_pct_overall == pytest.approx(300 / 7)
    assert score.cold_pct_p75 == pytest.approx(np.percentile([200 / 3, 25.0], 75))
    # idle loaded minutes: f0 has 13 loaded minutes, one of them (3) invoked; f1 has 6..10
    assert score.wasted_memory_mb_min == pytest.approx(12 * 100 + 5 * 50)


def test_scored_window_excludes_the_warm_up():
    counts = np.vstack([row([0, 250, 400], 500)])
    score = score_loaded(counts, np.array([10.0]), keepalive_loaded(counts, 10), warmup=240)
    assert score.invocations == 2 and score.cold_minutes == 2  # minute 0 is warm-up
    assert score.wasted_memory_mb_min == pytest.approx(20 * 10.0)


def test_hybrid_histogram_learns_a_ten_minute_timer():
    """Invocations every 10 minutes: a 4-hour keep-alive until 5 idle times, then pre-warm at 9, keep to 11."""
    counts = row(list(range(0, 101, 10)), 120)[None, :]
    loaded = hybrid_loaded(counts)
    score = score_loaded(counts, np.array([1.0]), loaded, warmup=0)
    assert score.cold_minutes == 1  # only the first invocation
    # idle loaded: minutes 1..49 but the 4 invocations (45), then minute t+9 of each later cycle (59..99: 5),
    # and 109..111 after the last one (3)
    assert score.wasted_memory_mb_min == pytest.approx(45 + 5 + 3)
    assert loaded[0, 51:59].sum() == 0 and loaded[0, 59] and loaded[0, 60]


@pytest.mark.parametrize(
    "idle_times, window",
    [
        ([10, 10, 10], (1, 240)),  # fewer than 5 idle times: 4-hour keep-alive
        ([10] * 6, (9, 11)),  # one bin: pre-warm at 90 % of p5, keep to 110 % of p99
        (list(range(1, 61)), (1, 240)),  # 60 bins of one: coefficient of variation 1.7 < 2, not representative
        ([5] * 20 + [100], (4, 110)),  # p5 = 5, p99 = 100
        ([300, 310, 320], (263, 357)),  # mostly out of range (checked first): mean of the last 3 = 310, 85..115 %
        ([300, 310, 320, 330, 340, 350], (289, 391)),  # mean of the last 3 = 340
    ],
)
def test_hybrid_windows_from_the_idle_time_histogram(idle_times, window):
    state = HybridHistogram(1)
    t = 0
    state.observe(t, np.array([True]))
    for gap in idle_times:
        t += gap
        state.observe(t, np.array([True]))
    assert (int(state.s[0]), int(state.e[0])) == window


def test_oracle_and_reactive_reference_points():
    counts = np.vstack([row([2, 3, 9], 12), row([0, 1], 12)])
    oracle = oracle_loaded(counts)
    score = score_loaded(counts, np.ones(2), oracle, warmup=0)
    assert score.cold_minutes == 2 and score.wasted_memory_mb_min == 0  # one cold start per function, no waste
    reactive = reactive_loaded(counts)  # 60 s stable window + 30 s grace: two minutes
    assert np.flatnonzero(reactive[0]).tolist() == [3, 4, 5, 10, 11]


def test_the_planner_with_perfect_forecasts_loads_exactly_the_invocation_minutes():
    counts = np.vstack([row([1, 2, 5, 9], 12), row([0, 6], 12, count=3), np.zeros(12)])
    loaded, info = planner_loaded(counts, np.array([128.0, 256.0, 512.0]), cold_cost=1.0,
                                  source_factory=OracleForecast)
    assert (loaded == (counts > 0)).all()
    assert set(info["actions_by_reason"]) <= {"forecast_demand", "forecast_spike", "idle_release"}


def test_the_causal_planner_trades_cold_starts_for_memory_with_its_cold_cost():
    rng = np.random.default_rng(3)
    counts = (rng.random((20, 300)) < np.linspace(0.01, 0.3, 20)[:, None]).astype(float)
    memory = np.full(20, 128.0)
    cheap, _ = planner_loaded(counts, memory, cold_cost=0.05)
    dear, _ = planner_loaded(counts, memory, cold_cost=20.0)
    s_cheap = score_loaded(counts, memory, cheap, warmup=60)
    s_dear = score_loaded(counts, memory, dear, warmup=60)
    assert s_dear.cold_minutes < s_cheap.cold_minutes
    assert s_dear.wasted_memory_mb_min > s_cheap.wasted_memory_mb_min


def test_budget_mode_moves_the_spend_towards_a_normalised_budget_causally():
    """From a cold cost far too high for the budget, budget mode lowers its factor, and a smaller budget spends
    less (the normalised waste: a 10-minute keep-alive = 100 %)."""
    from forecaster.planning.budget import WasteBudget

    rng = np.random.default_rng(7)
    rates = rng.choice([0.02, 0.05, 0.2, 0.6], size=20)
    counts = rng.poisson(rates[:, None], size=(20, 200)).astype(float)
    mb = rng.uniform(128, 1024, 20)
    reference = score_loaded(counts, mb, keepalive_loaded(counts, 10), warmup=60).wasted_memory_mb_min
    spent = {}
    for pct in (100.0, 40.0):
        loaded, info = planner_loaded(counts, mb, cold_cost=50.0, budget=WasteBudget(pct=pct))
        spent[pct] = 100.0 * score_loaded(counts, mb, loaded, warmup=60).wasted_memory_mb_min / reference
        assert info["budget"]["updates"] == 199 and 1e-3 <= info["budget"]["factor"] < 1.0
    assert spent[100.0] > spent[40.0]
