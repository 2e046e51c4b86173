"""Budget mode's controller (forecaster.planning.budget), the equal-cost readings of curves, and their settings."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from forecaster.planning.budget import (BudgetState, WasteBudget, budget_history, idle_gpu_seconds,
                                        keepalive_idle_gpu_seconds, spend_curve_log_factors, update_budget)
from forecaster.planning.step import waste_budget
from forecaster.settings import Settings, SettingsError, load_settings
from forecaster.simulation.curves import best_within, cost_at, gap_closed, value_at
from forecaster.simulation.minute import keepalive_loaded


def _run(budget: WasteBudget, *, scale: float, elasticity: float, steps: int, seed: int = 0,
         reference: float = 100.0, curve_error: float | None = None
         ) -> tuple[BudgetState, list[float], list[float], list[float]]:
    """A synthetic plant: spend per minute = scale x factor^elasticity x lognormal noise.

    With ``curve_error`` each minute's plan predicts its spend curve as that multiple of the plant's mean
    (the planner's spend curve, wrong by a constant factor); without it there is no curve (the integral step)."""
    rng = np.random.default_rng(seed)
    state = BudgetState()
    spent, allowed, factors = [], [], []
    grid = spend_curve_log_factors(budget.max_factor)
    for _ in range(steps):
        if curve_error is not None:
            state = state.with_curve(curve_error * scale * np.exp(grid * elasticity) * math.exp(0.5 ** 2 / 2))
        s = scale * state.factor ** elasticity * float(rng.lognormal(0.0, 0.5))
        before = state.allowed_total
        state = update_budget(state, budget, spent_gpu_s=s, reference_idle_gpu_s=reference)
        spent.append(s)
        allowed.append(state.allowed_total - before)
        factors.append(state.factor)
    return state, spent, allowed, factors


@pytest.mark.parametrize("curve_error", [1.0, 2.0, 0.5, None])
@pytest.mark.parametrize("scale,elasticity", [(20.0, 0.3), (300.0, 0.5), (100.0, 1.0)])
def test_the_controller_spends_the_budget_on_a_synthetic_stream(scale, elasticity, curve_error):
    # with spend curves (right or wrong by 2x either way) at the default window; without, the integral step
    # at a 30-minute window (its default gain 1/30: the 240-minute default is too slow for it to settle here)
    budget = WasteBudget(pct=100.0) if curve_error is not None else WasteBudget(pct=100.0, window_min=30.0)
    _, spent, allowed, factors = _run(budget, scale=scale, elasticity=elasticity, steps=1440,
                                      curve_error=curve_error)
    # after a 4-hour warm-up (the protocol's), the rest of the day spends within 5 % of what was allowed
    assert abs(sum(spent[240:]) / sum(allowed[240:]) - 1.0) < 0.05
    assert all(math.isfinite(f) and 1e-3 <= f <= 1e3 for f in factors)
    # and moves the cold cost the right way: up when it spent too little, down when too much
    assert (factors[-1] > 1.0) == (scale < 100.0)
    if curve_error is not None:  # the factor the plant needs: scale x f^elasticity = 100
        assert factors[-1] == pytest.approx((100.0 / scale) ** (1.0 / elasticity), rel=0.5)


def test_the_cold_cost_moves_the_right_way_step_by_step():
    budget = WasteBudget(gpu_seconds_per_hour=600.0)  # 10 a minute
    under = update_budget(BudgetState(), budget, spent_gpu_s=1.0, reference_idle_gpu_s=None)
    over = update_budget(BudgetState(), budget, spent_gpu_s=100.0, reference_idle_gpu_s=None)
    exact = update_budget(BudgetState(), budget, spent_gpu_s=10.0, reference_idle_gpu_s=None)
    assert under.factor > 1.0 > over.factor and exact.factor == pytest.approx(1.0)
    assert under.cold_cost(2.0) == pytest.approx(2.0 * under.factor)


def test_the_controller_is_bounded_and_never_nan():
    budget = WasteBudget(pct=50.0, max_factor=10.0)
    state = BudgetState()
    for _ in range(2000):  # nothing ever spent: the factor climbs to its bound and stays there
        state = update_budget(state, budget, spent_gpu_s=0.0, reference_idle_gpu_s=1e12)
    assert state.factor == pytest.approx(10.0)
    for _ in range(2000):  # everything overspent with nothing allowed: down to the other bound
        state = update_budget(state, budget, spent_gpu_s=1e15, reference_idle_gpu_s=0.0)
    assert state.factor == pytest.approx(0.1)
    for bad in (float("nan"), float("inf"), -1.0):  # bad measurements are ignored and counted
        after = update_budget(state, budget, spent_gpu_s=bad, reference_idle_gpu_s=1.0)
        assert after.log_factor == state.log_factor and after.ignored == state.ignored + 1
    after = update_budget(state, budget, spent_gpu_s=1.0, reference_idle_gpu_s=float("nan"))
    assert after.ignored == state.ignored + 1
    # nothing allowed and nothing spent: no move
    idle = update_budget(BudgetState(), budget, spent_gpu_s=0.0, reference_idle_gpu_s=0.0)
    assert idle.log_factor == 0.0


def test_the_status_says_when_the_budget_is_not_met_and_when_it_cannot_be():
    """A plant whose spend does not respond to the cold cost (elasticity 0) at 3x the allowance: settling for the
    first two hours, then over budget, then infeasible once the factor sits at its bound; a plant that
    responds settles on budget."""
    budget = WasteBudget(pct=100.0, window_min=60.0, max_factor=1000.0)
    state, statuses = BudgetState(), []
    for _ in range(600):
        state = update_budget(state, budget, spent_gpu_s=300.0, reference_idle_gpu_s=100.0)
        statuses.append(state.status)
    assert statuses[0] == "settling" and statuses[118] == "settling"  # 119 minutes over: under two hours
    assert statuses[119] == "over_budget" and state.over_minutes == 600.0
    first_infeasible = statuses.index("infeasible")
    assert state.factor == pytest.approx(1e-3) and set(statuses[first_infeasible:]) == {"infeasible"}
    assert set(statuses[119:first_infeasible]) == {"over_budget"}
    # the moment the spend falls within the allowance, the count starts again
    back = update_budget(state, budget, spent_gpu_s=0.0, reference_idle_gpu_s=1e6)
    assert back.status == "on_budget" and back.over_minutes == 0.0
    responsive, *_ = _run(budget, scale=300.0, elasticity=1.0, steps=600)
    assert responsive.status == "on_budget" and responsive.factor > 1e-3


def test_the_state_round_trips_through_a_plan_summary_and_garbage_starts_afresh():
    state = update_budget(BudgetState(), WasteBudget(pct=100.0), spent_gpu_s=3.0, reference_idle_gpu_s=10.0)
    assert BudgetState.from_dict(state.as_dict()) == state
    for garbage in (None, "x", {"log_factor": float("nan")}, {"log_factor": "1"}, {"spent": -1.0}):
        assert BudgetState.from_dict(garbage) == BudgetState()
    over = update_budget(BudgetState(), WasteBudget(pct=100.0), spent_gpu_s=30.0, reference_idle_gpu_s=10.0)
    assert over.status == "settling" and BudgetState.from_dict(over.as_dict()) == over
    # a state saved before the status existed reads as on budget; an unknown status too
    old = {k: v for k, v in over.as_dict().items() if k not in ("status", "over_minutes")}
    assert BudgetState.from_dict(old).status == "on_budget" and BudgetState.from_dict(old).over_minutes == 0.0
    assert BudgetState.from_dict({**over.as_dict(), "status": "bogus"}).status == "on_budget"


def test_a_budget_needs_a_finite_nonnegative_value():
    for bad in (dict(pct=-1.0), dict(pct=float("nan")), dict(gpu_seconds_per_hour=float("inf")), dict()):
        with pytest.raises(ValueError):
            WasteBudget(**bad)
    # with both forms the smaller allowance holds
    both = WasteBudget(pct=100.0, gpu_seconds_per_hour=60.0)
    assert both.allowed(1.0, 5.0) == 1.0 and both.allowed(1.0, 0.5) == 0.5


def test_settings_refuse_a_negative_or_nan_budget_with_a_clear_error(monkeypatch):
    for name, value in (("PREWARM_PLANNER_WASTE_BUDGET_GPU_SECONDS_PER_HOUR", "-5"),
                        ("PREWARM_PLANNER_WASTE_BUDGET_PCT", "nan"),
                        ("PREWARM_PLANNER_WASTE_BUDGET_PCT", "inf")):
        monkeypatch.setenv(name, value)
        with pytest.raises(SettingsError, match=name):
            load_settings()
        monkeypatch.delenv(name)
    assert waste_budget(Settings()) is None
    budget = waste_budget(Settings(planner_waste_budget_pct=80.0, planner_waste_budget_window_min=30.0))
    assert budget.pct == 80.0 and budget.gain_per_min == pytest.approx(1 / 30.0)
    assert waste_budget(Settings(), gpu_seconds_per_hour=10.0).gpu_seconds_per_hour == 10.0


def test_the_keepalive_reference_is_the_protocols_keepalive_waste_minute_by_minute():
    rng = np.random.default_rng(3)
    counts = (rng.random((40, 200)) < 0.08) * rng.integers(1, 5, (40, 200))
    gpus = rng.uniform(0.1, 2.0, 40)
    one_each = np.full(40, np.inf)
    loaded = keepalive_loaded(counts, 10)
    expected = ((loaded & (counts == 0)) * gpus[:, None]).sum(axis=0) * 60.0
    for t in range(1, 200):
        got = keepalive_idle_gpu_seconds(counts[:, max(0, t - 10):t + 1], one_each, gpus, minutes=10)
        assert got == pytest.approx(expected[t])
        assert idle_gpu_seconds(loaded[:, t], counts[:, t], one_each, gpus) == pytest.approx(expected[t])


def test_idle_gpu_seconds_counts_replicas_beyond_what_requests_needed():
    held = np.array([3, 1, 0, 2])
    counts = np.array([130.0, 0.0, 5.0, np.nan])  # 130 at 60/replica: 3 needed; NaN = unknown = no requests
    rpm = np.array([60.0, 60.0, 60.0, 60.0])
    gpus = np.array([2.0, 1.0, 1.0, 4.0])
    assert idle_gpu_seconds(held, counts, rpm, gpus) == (0 + 1 * 1 + 0 + 2 * 4) * 60.0


# --------------------------------------------------------------------------- curves at equal cost


def test_value_at_interpolates_along_the_curve_and_never_extrapolates():
    curve = [(10.0, 50.0), (20.0, 30.0), (40.0, 10.0)]
    assert value_at(curve, 15.0) == pytest.approx(40.0)
    assert value_at(curve, 40.0) == pytest.approx(10.0)
    assert value_at(curve, 30.0) == pytest.approx(20.0)
    assert value_at(curve, 9.99) is None and value_at(curve, 41.0) is None
    assert value_at(curve, None) is None and value_at([], 1.0) is None
    assert cost_at(curve, 40.0) == pytest.approx(15.0)
    assert cost_at(curve, 5.0) is None and cost_at(curve, 60.0) is None
    # grid order need not be sorted, and missing values drop out
    assert value_at([(40.0, 10.0), (None, 1.0), (10.0, 50.0)], 25.0) == pytest.approx(30.0)
    # a single point answers only at itself
    assert value_at([(5.0, 7.0)], 5.0) == 7.0 and value_at([(5.0, 7.0)], 5.1) is None


def test_a_non_monotone_curve_reads_its_best_crossing():
    curve = [(10.0, 50.0), (30.0, 10.0), (20.0, 20.0)]  # waste falls back between the last grid points
    assert value_at(curve, 25.0) == pytest.approx(15.0)  # crossings at 20 (seg 1) and 15 (seg 2): the lower


def test_best_within_reads_the_lowest_wait_at_or_below_a_cost():
    curve = [(10.0, 50.0), (20.0, 30.0), (40.0, 10.0)]
    assert best_within(curve, 30.0) == pytest.approx(20.0)  # inside the range: the reading there
    assert best_within(curve, 100.0) == pytest.approx(10.0)  # beyond the curve's end: its best point
    assert best_within(curve, 9.0) is None  # no point costs that little
    assert best_within(curve, None) is None and best_within([], 5.0) is None
    # a curve that falls below its reading at the limit before reaching it
    assert best_within([(10.0, 5.0), (20.0, 8.0), (40.0, 1.0)], 20.0) == pytest.approx(5.0)


def test_gap_closed():
    assert gap_closed(20.0, 10.0, 0.0) == pytest.approx(0.5)
    assert gap_closed(20.0, 25.0, 0.0) == pytest.approx(-0.25)
    assert gap_closed(20.0, None, 0.0) is None and gap_closed(1.0, 1.0, 1.0) is None


def test_busy_requests_counts_the_replica_time_requests_kept_busy():
    held = np.array([3, 1, 0])
    counts = np.array([90.0, 30.0, 5.0])  # at 60 a minute per replica: 1.5, 0.5 and 1/12 replica busy
    rpm = np.full(3, 60.0)
    gpus = np.array([2.0, 1.0, 1.0])
    assert idle_gpu_seconds(held, counts, rpm, gpus, busy="requests") == pytest.approx((1.5 * 2 + 0.5) * 60.0)
    # a keep-alive holding the 2 replicas minute 0 needed, through a minute with 30 requests: 1.5 replicas idle
    window = np.array([[90.0, 30.0]])
    assert keepalive_idle_gpu_seconds(window, rpm[:1], gpus[:1], busy="requests") == pytest.approx(1.5 * 2 * 60.0)
    with pytest.raises(ValueError):
        idle_gpu_seconds(held, counts, rpm, gpus, busy="magic")


def _one_minute_plan(p_any: np.ndarray, multiplier_state: BudgetState, busy: str):
    """A minute-protocol plan (one replica per model, 60 s cold starts) for models with the given ``p_any``."""
    import pandas as pd

    from forecaster.contracts.fleet import build_fleet
    from forecaster.contracts.phases import START_STATES
    from forecaster.planning.fleet import PlannerSettings
    from forecaster.planning.step import plan_step

    now = pd.Timestamp("2026-01-01", tz="UTC").to_pydatetime()
    ids = [f"m{i}" for i in range(len(p_any))]
    # a request when any: exactly one (every quantile at or above 1 - p_any is 1)
    levels = (0.1, 0.5, 0.9, 0.99)
    forecast = pd.DataFrame({"unique_id": ids, "ds": now, "p_any": p_any,
                             **{f"q{lv}": (lv >= 1.0 - p_any).astype(float) for lv in levels}})
    gpus = np.array([1.0, 2.0, 1.0, 4.0])[:len(p_any)]
    models = pd.DataFrame({"image_ref": None, "image_bytes": 0.0, "weights_uri": None, "weights_bytes": 0.0,
                           "gpus": gpus, "replica_rpm": 1e12, "slo_s": np.nan, "cold_cost": 1.0, "replicas": 0},
                          index=pd.Index(ids, name="model_id"))
    nodes = pd.DataFrame({"gpus_free": [1e6], "host_free_bytes": [0.0], "disk_free_bytes": [0.0]},
                         index=pd.Index(["n"], name="node_id"))
    latency = pd.DataFrame([{"model_id": i, "state": s, "total_s": 60.0} for i in ids for s in START_STATES])
    settings = PlannerSettings(horizon_min=1, tiers=False, count_queued_wait=False, lead_margin_s=0.0,
                               lead_margin_frac=0.0, replica_utilisation=1.0)
    return plan_step(now, forecast, build_fleet(models, nodes), latency, settings, budget=multiplier_state,
                     budget_busy=busy), gpus


def test_each_plan_predicts_what_it_would_spend_at_every_factor():
    """The spend curve of a plan in budget mode: a model is held where p C_cold >= (1 - p) C_idle, i.e. at factors
    from (1 - p) C_idle / (p C_cold) up; held and idle with probability 1 - p (whole replicas, as the minute
    protocol counts them). The curve is that sum, non-decreasing in the factor, and rides to the next update."""
    from forecaster.planning.step import budget_after

    p = np.array([0.01, 0.1, 0.5, 0.9])
    state = BudgetState()
    plan, gpus = _one_minute_plan(p, state, "replicas")
    after = budget_after(plan, state)
    curve = np.array(after.curve)
    assert len(curve) == 25 and (np.diff(curve) >= -1e-9).all()
    grid = np.exp(spend_curve_log_factors(1000.0))
    c_idle = gpus * 60.0  # gpu_second_cost 1
    threshold = (1 - p) * c_idle / (p * 60.0)  # C_cold = cold_cost x 60 s
    expected = [float(((f >= threshold) * (1 - p) * gpus * 60.0).sum()) for f in grid]
    assert curve == pytest.approx(expected)
    # the plan at factor 1 holds the two models above their threshold: what the curve says at 1 is what it holds
    assert {a.model_id for a in plan.actions if a.kind.value == "scale"} == {"m2", "m3"}
    # counted as the fleet counts busy time (share of a replica's capacity), the idle part is the whole replica
    plan_r, _ = _one_minute_plan(p, state, "requests")
    assert np.array(budget_after(plan_r, state).curve)[-1] == pytest.approx((gpus * 60.0).sum())
    # the next update reads it: the curve enters the window's sums and the factor comes from them
    updated = update_budget(after, WasteBudget(pct=100.0), spent_gpu_s=expected[12], reference_idle_gpu_s=30.0)
    assert len(updated.curve_sum) == 25 and updated.predicted == pytest.approx(expected[12])
    # allowance 30 GPU-s a minute with the curve right (bias 1) and spend 54 over it. After one minute of a
    # 240-minute window the pace error counts for 1 - exp(-1/240) of its log: the factor where the curve is
    # 30 x (30 / 54) ** 0.0042, just under 30
    grid, rising = spend_curve_log_factors(1000.0), np.maximum.accumulate(curve)
    fill = -np.expm1(-1.0 / 240.0)
    assert np.interp(updated.log_factor, grid, rising) == pytest.approx(30.0 * (30.0 / 54.0) ** fill, rel=1e-3)
    # with the window full (a state saved before its minutes were counted reads so), the whole pace error is repaid:
    # the curve at 30 x 30 / 54 = 16.7 GPU-s, below model m2's threshold of 1 and above m3's (spend 4 x 60 x 0.1 =
    # 24 > 16.7: nothing held meets it but the lowest factors)
    full = update_budget(replace(after, elapsed_min=None), WasteBudget(pct=100.0), spent_gpu_s=expected[12],
                         reference_idle_gpu_s=30.0)
    assert full.factor < 1.0 and np.interp(full.log_factor, grid, rising) <= 24.0 + 1e-6


def test_a_stored_curve_that_is_not_usable_is_dropped():
    state = BudgetState().with_curve(np.ones(25))
    assert BudgetState.from_dict(state.as_dict()) == state
    for bad in ([1.0] * 24, [float("nan")] * 25, [-1.0] * 25, ["a"] * 25, "x", None):
        assert BudgetState.from_dict({**state.as_dict(), "curve": bad}).curve == ()
    assert BudgetState().with_curve([float("inf")] * 25).curve == ()


def test_each_update_keeps_its_interval_and_the_history_counts_each_once():
    budget = WasteBudget(pct=100.0)
    curve = np.linspace(0.0, 48.0, 25)  # idle GPU-s per minute at each grid factor
    first = update_budget(BudgetState(), budget, spent_gpu_s=3.0, reference_idle_gpu_s=10.0).with_curve(curve)
    assert (first.interval_min, first.interval_spent, first.interval_allowed) == (1.0, 3.0, 10.0)
    assert first.interval_predicted is None and BudgetState().predicted_next_minute() is None
    assert first.predicted_next_minute() == pytest.approx(np.interp(first.log_factor, spend_curve_log_factors(1000.0),
                                                                    curve))
    second = update_budget(first, budget, spent_gpu_s=50.0, reference_idle_gpu_s=20.0, minutes=2.0)
    assert second.interval_predicted == pytest.approx(first.predicted_next_minute() * 2.0)
    assert (second.interval_min, second.interval_spent, second.interval_allowed) == (2.0, 50.0, 20.0)
    ignored = update_budget(second, budget, spent_gpu_s=float("nan"), reference_idle_gpu_s=1.0)
    assert ignored.ignored == 1 and ignored.interval_min == 0.0 and ignored.interval_predicted is None
    # a state saved before the interval fields reads with none; unusable values are dropped one by one
    old = {k: v for k, v in second.as_dict().items() if not k.startswith("interval_")}
    assert BudgetState.from_dict(old).interval_min == 0.0 and BudgetState.from_dict(old).interval_predicted is None
    assert BudgetState.from_dict({**second.as_dict(), "interval_spent": -1.0}).interval_spent == 0.0
    assert BudgetState.from_dict({**second.as_dict(), "interval_predicted": "x"}).interval_predicted is None
    # the history: fresh and unusable states give no point, a state carried unchanged (same minute) one point
    rows = [("t0", BudgetState().as_dict()), ("t1", first.as_dict()), ("t2", "garbage"), ("t3", second.as_dict()),
            ("t4", second.as_dict())]
    points = budget_history(rows)
    assert [p.planned_at for p in points] == ["t1", "t3"]
    assert [p.spent_gpu_s for p in points] == [3.0, 50.0] and points[1].window_spent_pct == pytest.approx(
        100.0 * second.spent / second.allowed)


def test_a_fleet_s_first_minutes_do_not_drive_the_factor_to_its_bound():
    """A fresh fleet spends little at first (its replicas are still starting) while the allowance flows: the demo's
    replay went to 1000 x at its second plan and overspent for hours. Read over two minutes of a 240-minute
    window, neither the pace error nor the curves' bias is extrapolated to the whole window, and the allowance of
    the minute no curve predicted is not asked of the curve."""
    budget = WasteBudget(pct=100.0)
    curve = np.linspace(3000.0, 21000.0, 25)  # idle GPU-s per minute; 12,000 at factor 1
    state = update_budget(BudgetState(), budget, spent_gpu_s=0.0, reference_idle_gpu_s=15000.0).with_curve(curve)
    after = update_budget(state, budget, spent_gpu_s=1680.0, reference_idle_gpu_s=15000.0)
    grid = spend_curve_log_factors(budget.max_factor)
    assert 14000.0 < np.interp(after.log_factor, grid, curve) < 16000.0  # the curve at about one minute's allowance
    assert 5.0 < after.factor < 20.0
    # the same sums read as a full window, every interval covered (the law before): the bound
    old_law = update_budget(replace(state, elapsed_min=None, covered_spent=0.0, covered_allowed=15000.0), budget,
                            spent_gpu_s=1680.0, reference_idle_gpu_s=15000.0)
    assert old_law.factor == pytest.approx(budget.max_factor)
    # a full window of steady spend at the allowance keeps the factor where the curve meets it
    steady = after
    for _ in range(600):
        spent = float(np.interp(steady.log_factor, grid, curve))  # the curve is right
        steady = update_budget(steady.with_curve(curve), budget, spent_gpu_s=spent, reference_idle_gpu_s=8000.0)
    assert steady.status == "on_budget" and steady.elapsed_min == pytest.approx(602.0)
    assert np.interp(steady.log_factor, grid, curve) == pytest.approx(8000.0, rel=0.05)


def test_a_state_saved_before_the_window_share_was_kept_reads_as_a_full_window():
    """Plans stored before 2bbca5d carry no covered sums and no elapsed minutes: the old law, not a fresh start."""
    budget = WasteBudget(pct=100.0)
    state = update_budget(BudgetState(), budget, spent_gpu_s=50.0, reference_idle_gpu_s=40.0).with_curve(
        np.linspace(0.0, 100.0, 25))
    saved = {k: v for k, v in state.as_dict().items() if k not in ("covered_spent", "covered_allowed", "elapsed_min")}
    old = BudgetState.from_dict(saved)
    assert old.elapsed_min is None and (old.covered_spent, old.covered_allowed) == (state.spent, state.allowed)
    assert BudgetState.from_dict(old.as_dict()) == old  # None survives the plan summary's JSON
    assert BudgetState.from_dict(state.as_dict()) == state and state.elapsed_min == 1.0
    assert update_budget(old, budget, spent_gpu_s=50.0, reference_idle_gpu_s=40.0).elapsed_min is None
